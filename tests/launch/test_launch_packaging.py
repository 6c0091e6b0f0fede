"""The built wheel holds every package folder as `miles.<folder>`, found without a list to edit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folders that are not part of the installed package (setup.cfg [miles.packaging] not_packaged).
OUTSIDE = {"tests", "bench", "scripts", "examples", "docs", "build"}


def package_folders() -> set[str]:
    """Every folder below the root with an `__init__.py`, reached through package folders only."""
    found: set[str] = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if not rel.parts or rel.parts[0] in OUTSIDE or rel.parts[0].startswith("."):
            continue
        if all((ROOT.joinpath(*rel.parts[: i + 1]) / "__init__.py").is_file()
               for i in range(len(rel.parts))):
            found.add("/".join(rel.parts))
    return found


@pytest.mark.timeout(300)
def test_wheel_holds_every_package_folder(tmp_path: Path) -> None:
    # Build from a copy so the build leaves nothing (build/, *.egg-info) in the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".pp", "tests", "bench", "docs", "examples", "runs", "build",
        "*.egg-info", "__pycache__", ".ruff_cache", ".hypothesis", "tmp"))
    # A folder added with no other edit is packaged too.
    (src / "newfolder" / "inner").mkdir(parents=True)
    for folder in ("newfolder", "newfolder/inner"):
        (src / folder / "__init__.py").write_text("")
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, timeout=280, capture_output=True)
    (wheel,) = out.glob("miles-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    folders = package_folders()
    assert {"core", "transport/bulk", "actors/runtime", "rollout/envs"} <= folders
    missing = sorted(f for f in folders if f"miles/{f}/__init__.py" not in names)
    assert not missing, f"package folders missing from the wheel: {missing}"
    # Every module of a package folder is in it, and nothing from outside the package.
    for folder in folders:
        for module in (ROOT / folder).glob("*.py"):
            assert f"miles/{folder}/{module.name}" in names
    assert {"miles/newfolder/__init__.py", "miles/newfolder/inner/__init__.py"} <= names
    assert "miles/__init__.py" in names
    assert "miles/setup.py" not in names
    assert not [n for n in names if n.startswith(("miles/tests/", "miles/bench/"))]
