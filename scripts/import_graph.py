"""Print miles' folder-level import graph, and the import cycles among folders and among files.

Reads the package's sources with `ast` (nothing is imported). A folder is a top-level package
(`core`, `transport`, ...); an edge `a -> b  (n)` means n import statements in folder a name a
module of folder b. Every import counts: at module level, inside functions, under
TYPE_CHECKING, and a module named in a string ("miles.x.y" or "miles.x.y:attr", as
importlib and the registries load them), since each one is a dependency a reader follows.

    python scripts/import_graph.py            # edges, folder cycles, file cycles
    python scripts/import_graph.py --check    # exit 1 on a folder cycle, an edge MAY_IMPORT forbids,
                                              # or an import past ENTRY_ONLY's entry modules

The file cycles are the strongly connected components of the file graph with more than one file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "miles"
# Folders that are not part of the installed package.
SKIP = {"tests", "bench", "scripts", "examples", "docs", "build", ".venv", ".pp", ".ci"}
# The folders each folder may import (docs/ARCHITECTURE.md, "Layout"); a folder not listed may
# import any. Checked on import statements (a module named in a string loads late, by design).
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "transport": {"core"},
    "models": {"core"},
    "weightsync": {"core", "models", "transport"},
    "engines": {"core", "models", "transport", "weightsync"},
    "trainer": {"core", "models", "transport", "weightsync"},
    "rollout": {"core"},
    "metrics": {"core"},
    "warmup": {"core", "models", "rollout"},
    "sessions": {"core", "rollout"},
    "actors": {"core", "transport", "models", "engines", "trainer", "rollout", "sessions", "metrics",
               "weightsync"},
    "perftest": {"core", "transport", "weightsync", "actors"},
    "diffusion": {"core", "transport", "weightsync", "actors", "engines", "models", "trainer", "rollout",
                  "metrics"},
}
# Folders that may import another only through its entry modules: the role actors call the
# weight sync's entry points (issue 46: the actors hold no sync logic), not its parts.
ENTRY_ONLY: dict[tuple[str, str], set[str]] = {
    ("actors", "weightsync"): {"weightsync.actor_wire", "weightsync.trainer_side", "weightsync.receiver",
                               "weightsync.messages", "weightsync.control"},
}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name (without `miles.`) -> file, for every package source file."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or len(rel.parts) < 2:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """The package modules a file depends on (dotted, without `miles.`), each with whether it is
    named in a string (loaded late) rather than by an import statement."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: list[tuple[str, bool]] = []
    # Logger names ("miles.trainer") read like modules but load nothing.
    log_names = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", getattr(node.func, "attr", "")) == "get_logger"
                 for arg in node.args}
    for node in ast.walk(tree):
        targets: list[str] = []
        named = False
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                mod = f"{PACKAGE}.{mod}" if mod else PACKAGE
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in log_names:
            # A module named in a string (importlib.import_module, a registry's "pkg.mod:attr")
            # is a dependency too, loaded later.
            text = node.value.partition(":")[0]
            if text.startswith(PACKAGE + ".") and text.replace(".", "").replace("_", "").isalnum():
                targets = [text]
                named = True
        for target in targets:
            if not target.startswith(PACKAGE + "."):
                continue
            dotted = target[len(PACKAGE) + 1 :]
            # The longest known module the name starts with (`from a.b import c` may name a
            # module `a.b.c` or an attribute of `a.b`).
            while dotted and dotted not in modules:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name:
                found.append((dotted, named))
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return sorted(comps)


def folder_of(module: str) -> str:
    return module.split(".")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on a folder import cycle, an import MAY_IMPORT forbids or one past ENTRY_ONLY")
    args = parser.parse_args()

    modules = module_files(ROOT)
    file_graph: dict[str, set[str]] = defaultdict(set)  # import statements only
    imported: dict[tuple[str, str], set[str]] = defaultdict(set)  # folder edge -> files
    named: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target, by_name in imports_of(path, name, modules):
            if not by_name:
                file_graph[name].add(target)
            src, dst = folder_of(name), folder_of(target)
            if src != dst:
                (named if by_name else imported)[(src, dst)].add(name)
    named = {edge: files for edge, files in named.items() if edge not in imported}

    def graph_of(*edge_sets: dict[tuple[str, str], set[str]]) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = defaultdict(set)
        for edge_set in edge_sets:
            for src, dst in edge_set:
                graph[src].add(dst)
        return graph

    def print_cycles(title: str, graph: dict[str, set[str]]) -> list[list[str]]:
        cycles = strongly_connected(graph)
        print(f"{title}: {len(cycles)}")
        for comp in cycles:
            pairs = [f"{a}->{b}" for a in comp for b in sorted(graph[a]) if b in comp]
            print(f"  {' <-> '.join(comp)}: {', '.join(pairs)}")
        return cycles

    print(f"folder import edges ({len(imported)}; n = files of the source folder importing it):")
    for (src, dst), files in sorted(imported.items()):
        print(f"  {src} -> {dst}  ({len(files)})")
    print(f"folder edges only by a module named in a string ({len(named)}):")
    for (src, dst), files in sorted(named.items()):
        print(f"  {src} -> {dst}  ({', '.join(sorted(files))})")
    forbidden = sorted((src, dst) for src, dst in imported if src in MAY_IMPORT and dst not in MAY_IMPORT[src])
    print(f"folder edges the layout does not allow: {len(forbidden)}")
    for src, dst in forbidden:
        print(f"  {src} -> {dst}  ({', '.join(sorted(imported[(src, dst)]))})")
    past_entry = sorted({(name, target) for name, path in modules.items()
                        for target, by_name in imports_of(path, name, modules)
                        if not by_name and (folder_of(name), folder_of(target)) in ENTRY_ONLY
                        and target not in ENTRY_ONLY[(folder_of(name), folder_of(target))]})
    print(f"imports past a folder's entry modules: {len(past_entry)}")
    for name, target in past_entry:
        print(f"  {name} -> {target}")
    folder_cycles = print_cycles("folder cycles (imports)", graph_of(imported))
    print_cycles("folder cycles (imports + named modules)", graph_of(imported, named))
    file_cycles = strongly_connected(file_graph)
    print(f"file cycles (imports): {len(file_cycles)}")
    for comp in file_cycles:
        print(f"  {len(comp)} files: {', '.join(comp)}")
    return 1 if args.check and (folder_cycles or forbidden or past_entry) else 0


if __name__ == "__main__":
    sys.exit(main())
