"""Find tests that wait on the clock: a fixed sleep followed, in the same block, by an assert.

A test that sleeps a fixed time and then asserts is slow where the event comes early and flaky
where it comes late (a loaded CI runner); it should wait for the condition with a deadline. A
sleep counts when it is a call to `time.sleep` or `asyncio.sleep` (or a bare `sleep`) with a
constant of at least 0.05 s, outside any loop (a sleep inside a `while`/`for` is a poll step),
and a later statement of its block holds an `assert`. Where a window in which nothing may happen
IS the point of the test, the sleep line carries a comment `# fixed on purpose: <reason>`.

    python scripts/sleep_check.py [ROOT]   # ROOT defaults to the repository's tests/

Prints each sleep, the files and their count; exits 1 when more than MAX_FILES files hold one or
any of them lacks a reason.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILES = 5  # issue 46's goal: at most 5 test files with a fixed sleep before an assertion
MIN_SECONDS = 0.05  # shorter sleeps are a yield to the loop, not a wait for something
REASON = re.compile(r"#.*fixed on purpose:\s*(\S.*)$")
LOOPS = (ast.For, ast.AsyncFor, ast.While)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass(frozen=True)
class Sleep:
    path: Path
    line: int
    seconds: float
    assert_line: int
    reason: str  # empty when the sleep is not justified


def sleep_seconds(stmt: ast.stmt) -> float | None:
    """The constant a `sleep(...)` / `await ...sleep(...)` statement waits, or None."""
    if not isinstance(stmt, ast.Expr):
        return None
    call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
    if not isinstance(call, ast.Call) or not call.args:
        return None
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
    if name != "sleep" or owner not in (None, "time", "asyncio"):
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, int | float) and not isinstance(arg.value, bool):
        return float(arg.value)
    return None


def first_assert(stmts: list[ast.stmt]) -> int | None:
    """Line of the first assert in these statements, not looking into nested functions or classes."""
    todo: list[ast.AST] = list(stmts)
    found: list[int] = []
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assert):
            found.append(node.lineno)
        elif not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))
    return min(found) if found else None


def blocks(node: ast.AST, in_loop: bool = False) -> Iterator[tuple[list[ast.stmt], bool]]:
    """Every statement list under node, with whether it lies inside a loop of the same function."""
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            loop_here = in_loop or (isinstance(node, LOOPS) and field == "body")  # a loop's else runs once
            yield stmts, loop_here
            for stmt in stmts:
                yield from blocks(stmt, False if isinstance(stmt, SCOPES) else loop_here)
    for child in getattr(node, "handlers", []) + getattr(node, "cases", []):
        yield from blocks(child, in_loop or isinstance(node, LOOPS))


def sleeps_in(path: Path) -> list[Sleep]:
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for stmts, in_loop in blocks(ast.parse(text, str(path))):
        if in_loop:
            continue
        for i, stmt in enumerate(stmts):
            seconds = sleep_seconds(stmt)
            if seconds is None or seconds < MIN_SECONDS:
                continue
            after = first_assert(stmts[i + 1:])
            if after is None:
                continue
            match = REASON.search(lines[stmt.lineno - 1])
            out.append(Sleep(path, stmt.lineno, seconds, after, match.group(1).strip() if match else ""))
    return sorted(out, key=lambda s: s.line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=ROOT / "tests")
    root = parser.parse_args().root.resolve()
    found = [s for path in sorted(root.rglob("*.py")) for s in sleeps_in(path)]
    files = sorted({s.path for s in found})
    for s in found:
        why = f"fixed on purpose: {s.reason}" if s.reason else "UNJUSTIFIED: wait for the condition instead"
        print(f"{s.path.relative_to(root)}:{s.line}: sleep({s.seconds:g}) before the assert at line "
              f"{s.assert_line}; {why}")
    unjustified = sum(1 for s in found if not s.reason)
    print(f"files with a fixed sleep before an assert: {len(files)} (at most {MAX_FILES})")
    print(f"unjustified sleeps: {unjustified}")
    return 1 if len(files) > MAX_FILES or unjustified else 0


if __name__ == "__main__":
    sys.exit(main())
