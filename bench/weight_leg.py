"""Which folders the weight leg of a step runs through: a traced launched run (CPU).

Launches `miles train` (the quick start by default) for a few steps with a profiler in every
role process (a `sitecustomize` this script writes to a temporary folder and puts first on
PYTHONPATH). The profiler records each miles function that runs with a `weightsync/` frame on
its stack (imports and constructors left out: they are wiring, not a step's push), the caller
of the outermost such frame (the leg's entry: the actor that calls the weight sync), and every
call whose caller and callee sit in different folders. Coroutines started as tasks by a
weightsync function keep it as their root frame, so the sends of a push are counted too.

    python bench/weight_leg.py                       # examples/quickstart.toml, 2 steps
    python bench/weight_leg.py --set sync.transport=broadcast

Prints, per role process, the folders whose functions ran on the leg, each with its role, the
calls into the sync and out of it, then one JSON object as the last line. A folder is a
top-level package folder, with `transport/bulk` (the byte channels) and `actors/runtime` (the
actor wire) told apart from the rest of their folder; files of the checkout that are not the
package (a `.venv` inside it, tests, bench) are not counted. Roles:

- sync: the sync's own code, `weightsync/` and `transport/bulk/` (`n_sync_folders`: the
  issue-46 goal "the weight leg crosses at most 2 folders");
- wire: `actors/runtime/` and `transport/`, which carry the control steps' asks;
- endpoint: what the sync is called from or calls through a Protocol: the role actors'
  handlers and callbacks (`actors/`), the trainer's export (`trainer/`), the engine's
  install/commit (`engines/`), HF-name and FP8 helpers (`models/`), config and logging (`core/`).
  Listed by function, so what runs there can be read, not only counted.

`n_top_level_folders` and `n_folder_crossings` count every folder as before (comparable with
older results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRACER = r'''
import os, sys, threading
_OUT = os.environ.get("MILES_LEG_TRACE")
if _OUT:
    _ROOTS = tuple(p.rstrip("/") + "/" for p in os.environ["MILES_LEG_ROOTS"].split(os.pathsep))
    _seen = set()
    _f = None
    # in the repository but not the package (a venv inside the checkout holds torch and friends)
    _NOT_PACKAGE = ("tests/", "bench/", "scripts/", "examples/", "docs/", ".venv/", "build/", ".ci/", ".pp/")
    # a push's wiring, made once before the first step (constructors, the publisher's factory)
    _WIRING = {"__init__", "make_publisher", "pushes"}

    def _rel(fn):
        for r in _ROOTS:
            if fn.startswith(r):
                rel = fn[len(r):]
                return None if rel.startswith(_NOT_PACKAGE) else rel
        return None

    def _emit(key):
        global _f
        if key in _seen:
            return
        _seen.add(key)
        if _f is None:
            _f = open(os.path.join(_OUT, f"{os.getpid()}.tsv"), "a", buffering=1)
            _f.write("argv\t" + " ".join(sys.argv)[:300] + "\n")
        _f.write("\t".join(key) + "\n")

    def _caller(frame):
        # A task's root coroutine is called by the event loop: it has no miles caller.
        c = frame.f_back
        while c is not None and _rel(c.f_code.co_filename) is None:
            if "/asyncio/" in c.f_code.co_filename:
                return None
            c = c.f_back
        return c

    def _hook(frame, event, arg):
        if event != "call":
            return
        rel = _rel(frame.f_code.co_filename)
        if rel is None:
            return
        f, depth, outer, imp, imp_at_outer = frame, 0, None, False, False
        while f is not None and depth < 120:
            imp = imp or f.f_code.co_name == "<module>"
            r = _rel(f.f_code.co_filename)
            if r is not None and r.startswith("weightsync/"):
                outer, imp_at_outer = f, imp
            f, depth = f.f_back, depth + 1
        if outer is None or imp_at_outer or outer.f_code.co_name in _WIRING:
            return
        _emit(("call", rel, frame.f_code.co_name))
        c = _caller(frame)
        if c is not None and _rel(c.f_code.co_filename) != rel:
            kind = "entry" if outer is frame else "edge"
            _emit((kind, _rel(c.f_code.co_filename), c.f_code.co_name, rel, frame.f_code.co_name))

    sys.setprofile(_hook)
    threading.setprofile(_hook)
'''


# The sync's own code: the protocol, plans, exports' layout and landing (weightsync/) and the
# byte channels (transport/bulk/). Everything else the leg runs is the actor wire the control
# steps travel on, or an endpoint the sync calls through a Protocol or is called from.
SYNC = ("weightsync", "transport/bulk")
WIRE = ("actors/runtime", "transport")


def folder(rel: str) -> str:
    parts = rel.split("/")
    if len(parts) > 2 and parts[0] in ("transport", "actors") and parts[1] in ("bulk", "runtime"):
        return f"{parts[0]}/{parts[1]}"
    return parts[0] if len(parts) > 1 else "(root)"


def package_roots() -> list[str]:
    """Where `miles` is imported from in the role processes (as given and resolved)."""
    out = subprocess.run([sys.executable, "-c", "import miles, os; print(os.path.dirname(miles.__file__))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    return sorted({out, os.path.realpath(out)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "quickstart.toml"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra --set overrides for the run")
    ap.add_argument("--timeout", type=float, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="miles-weight-leg-") as tmp:
        t = Path(tmp)
        (t / "site").mkdir()
        (t / "site" / "sitecustomize.py").write_text(TRACER)
        (t / "trace").mkdir()
        env = {**os.environ, "MILES_LEG_TRACE": str(t / "trace"),
               "MILES_LEG_ROOTS": os.pathsep.join(package_roots()),
               "PYTHONPATH": os.pathsep.join([str(t / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])}
        sets = [f"run.dir={t / 'run'}", f"run.steps={args.steps}", "run.warmup_sft_steps=0", *args.set]
        cmd = [sys.executable, "-m", "miles.launch.cli", "train", args.config]
        for s in sets:
            cmd += ["--set", s]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if run.returncode != 0:
            sys.exit(f"the traced run failed (rc {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
        roles: dict[str, list[list[str]]] = {}
        for f in sorted((t / "trace").glob("*.tsv")):
            rows = [ln.split("\t") for ln in f.read_text().splitlines()]
            argv = rows[0][1].split()
            role = argv[1] if len(argv) > 1 else f.stem
            roles[f"{role}#{f.stem}"] = rows[1:]
    report: dict[str, object] = {"config": os.path.relpath(args.config, ROOT), "steps": args.steps, "sets": args.set}
    report.update(summarize(roles))
    print(json.dumps(report))


def role_of(fo: str) -> str:
    """What a folder is to the leg: the sync's own code, the actor wire, or an endpoint it calls."""
    if fo in SYNC:
        return "sync"
    return "wire" if fo in WIRE else "endpoint"


def summarize(roles: dict[str, list[list[str]]]) -> dict[str, object]:
    """Print each process's folders by role, the entries into the sync and its calls out; the numbers."""
    all_folders: set[str] = set()
    all_cross: set[tuple[str, str]] = set()
    per_role: dict[str, object] = {}
    outside: dict[str, set[str]] = defaultdict(set)  # endpoint/wire folder -> its functions on the leg
    print(f"{'process':<22} {'folder':<18} {'role':<9} {'functions':>9}  e.g.")
    for role, rows in roles.items():
        funcs: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            if r[0] == "call":
                funcs[folder(r[1])].add(f"{r[1]}:{r[2]}")
            elif r[0] == "entry":
                funcs[folder(r[1])].add(f"{r[1]}:{r[2]}")
        entries = sorted({f"{r[1]}:{r[2]} -> {r[3]}:{r[4]}" for r in rows
                          if r[0] in ("edge", "entry") and role_of(folder(r[1])) != "sync"
                          and role_of(folder(r[3])) == "sync"})
        calls_out = sorted({f"{r[1]}:{r[2]} -> {r[3]}:{r[4]}" for r in rows
                            if r[0] == "edge" and role_of(folder(r[1])) == "sync"
                            and role_of(folder(r[3])) != "sync"})
        cross = sorted({(folder(r[1]), folder(r[3])) for r in rows if r[0] in ("edge", "entry")
                        if folder(r[1]) != folder(r[3])})
        for fo in sorted(funcs):
            print(f"{role:<22} {fo:<18} {role_of(fo):<9} {len(funcs[fo]):>9}  {sorted(funcs[fo])[0]}")
            if role_of(fo) != "sync":
                outside[fo] |= funcs[fo]
        print(f"{role:<22} into the sync: " + "; ".join(entries))
        print(f"{role:<22} out of the sync: " + "; ".join(calls_out))
        all_folders |= set(funcs)
        all_cross |= set(cross)
        per_role[role.split("#")[0]] = {"folders": {fo: role_of(fo) for fo in sorted(funcs)}, "into_sync": entries,
                                        "out_of_sync": calls_out,
                                        "crossings": [f"{a}->{b}" for a, b in cross]}
    sync = sorted(f for f in all_folders if role_of(f) == "sync")
    top = sorted({f.split("/")[0] for f in all_folders})
    print(f"folders holding the sync's own code on the leg: {len(sync)} ({', '.join(sync)})")
    print("folders the leg calls into (endpoints: the actors' entries and callbacks, the trainer's export, the "
          "engine's install/commit, helpers; and the actor wire):")
    for fo in sorted(outside):
        names = sorted(outside[fo])
        print(f"  {fo:<16} {role_of(fo):<9} {len(names):>3}  {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    by_file: dict[str, int] = defaultdict(int)
    for names in outside.values():
        for n in names:
            by_file[n.split(":")[0]] += 1
    print("their functions on the leg, by file: " + ", ".join(f"{f} {n}" for f, n in sorted(by_file.items())))
    print(f"all top-level folders on the leg: {len(top)} ({', '.join(top)}); distinct folder-to-folder call "
          f"directions: {len(all_cross)}")
    return {"per_process": per_role, "sync_folders": sync, "n_sync_folders": len(sync),
            "endpoint_folders": {fo: sorted(outside[fo]) for fo in sorted(outside)}, "endpoint_files": dict(by_file),
            "folders": sorted(all_folders), "top_level_folders": top, "n_top_level_folders": len(top),
            "n_folder_crossings": len(all_cross)}

if __name__ == "__main__":
    main()
