"""Type-check the package with mypy (pinned in pyproject.toml's dev extra, configured in its
[tool.mypy]) and hold the `# type: ignore` budget: at most MAX_IGNORES in the package, each with
its error code and the reason after it on its line (`# type: ignore[code]  # why`).

mypy resolves `miles.x` imports to files by folder name, and the repository root IS the `miles`
package under whatever name the clone has, so the check runs over a `miles` link to the root in
a temporary folder (as an editable install's import hook is invisible to mypy).

    python scripts/typecheck.py    # exit 1 on a type error or an ignore over budget / unexplained
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_IGNORES = 10
# Folders that are not part of the installed package (setup.cfg's not_packaged, as
# scripts/names_check.py).
SKIP = {"tests", "bench", "scripts", "examples", "docs", "build", ".venv", ".pp", ".ci"}
IGNORE = re.compile(r"#\s*type:\s*ignore\b(\[[^\]]*\])?(.*)$")


def package_files() -> list[Path]:
    # hidden top-level folders (.carry, .git, ...) hold payloads and tools, never the package
    return [p for p in sorted(ROOT.rglob("*.py"))
            if (top := p.relative_to(ROOT).parts[0]) not in SKIP and not top.startswith(".") and p.name != "setup.py"]


def ignore_problems() -> tuple[int, list[str]]:
    """The count of `# type: ignore` in the package and the lines that break the rule."""
    count, problems = 0, []
    for path in package_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = IGNORE.search(line)
            if m is None:
                continue
            count += 1
            where = f"{path.relative_to(ROOT)}:{n}"
            if not m.group(1):
                problems.append(f"{where}: `# type: ignore` without an error code")
            if not re.search(r"#\s*\S", m.group(2)):
                problems.append(f"{where}: `# type: ignore` without `# reason` after it")
    if count > MAX_IGNORES:
        problems.append(f"{count} `# type: ignore` in the package, at most {MAX_IGNORES}")
    return count, problems


def run_mypy() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "miles").symlink_to(ROOT, target_is_directory=True)
        env = {**os.environ, "MYPYPATH": tmp}
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "miles"]
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


def main() -> int:
    count, problems = ignore_problems()
    for p in problems:
        print(p)
    print(f"type: ignore in the package: {count} (at most {MAX_IGNORES})")
    rc = run_mypy()
    return 1 if rc or problems else 0


if __name__ == "__main__":
    sys.exit(main())
