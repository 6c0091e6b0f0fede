"""Check two naming rules over the installed package: no two classes share a name, and every
file a docstring or comment names exists.

A named file is a token ending in `.py` in a module's text (docstrings and comments, since a
reader follows both). It resolves against the repository root, the file's own folder or its
parent folder (a docstring in `actors/runtime/` may say `host.py` or `runtime/host.py`).

    python scripts/names_check.py           # list duplicate classes and stale file names
    python scripts/names_check.py --check   # exit 1 if any
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders that are not part of the installed package (as scripts/import_graph.py).
SKIP = {"tests", "bench", "scripts", "examples", "docs", "build", ".venv", ".pp", ".ci"}
# Names that are not repository files by design: a user's script in an example, the sandbox's
# own file, paths inside a third-party package.
ELSEWHERE = ("my_eval.py", "main.py", "sglang/")
# A path-like token ending in .py; a dotted name before it (`miles.x.py`) is not one.
FILE_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def package_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py"))
            if p.relative_to(ROOT).parts[0] not in SKIP and len(p.relative_to(ROOT).parts) > 1]


def duplicate_classes(files: list[Path]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return {name: places for name, places in sorted(where.items()) if len(places) > 1}


def exists(name: str, here: Path) -> bool:
    # A name outside the package (setup.py, a test or bench script) resolves at the root too.
    return any((base / name).is_file() for base in (ROOT, here, here.parent))


def stale_names(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in FILE_NAME.findall(line):
                if not name.startswith(ELSEWHERE) and not exists(name, path.parent):
                    out.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a duplicate class or a stale name")
    args = parser.parse_args()
    files = package_files()
    dups = duplicate_classes(files)
    print(f"duplicate class names: {len(dups)}")
    for name, places in dups.items():
        print(f"  {name}: {', '.join(places)}")
    stale = stale_names(files)
    print(f"named files that do not exist: {len(stale)}")
    for line in stale:
        print(f"  {line}")
    return 1 if args.check and (dups or stale) else 0


if __name__ == "__main__":
    sys.exit(main())
