"""miles.sh installs once, again only when pyproject.toml changes, and says what it does.

The virtualenv is a scratch one whose `pip` and `miles` record their calls (the script's
decisions are what is tested, not pip).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _venv(tmp: Path) -> Path:
    v = tmp / "venv"
    (v / "bin").mkdir(parents=True)
    os.symlink(sys.executable, v / "bin" / "python")
    for tool in ("pip", "miles"):
        f = v / "bin" / tool
        f.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp}/calls"\n')
        f.chmod(0o755)
    return v


def _run(tmp: Path, venv: Path) -> tuple[str, list[str]]:
    calls = tmp / "calls"
    calls.unlink(missing_ok=True)
    p = subprocess.run(["bash", str(tmp / "repo" / "miles.sh"), "config", "x.toml"], capture_output=True,
                       text=True, timeout=50, env={**os.environ, "MILES_VENV": str(venv)})
    assert p.returncode == 0, p.stderr
    return p.stderr, calls.read_text().splitlines() if calls.exists() else []


def test_reinstalls_only_when_the_dependency_list_changes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "miles.sh", repo / "miles.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    venv = _venv(tmp_path)
    err, calls = _run(tmp_path, venv)
    assert "installing the dependencies" in err and "up to date" in err
    assert calls == ["pip install -q torch==2.13.0", "pip install -q -e .[dev,tb,ucx]", "miles config x.toml"]
    marker = (venv / ".miles-installed").read_text().strip()
    assert marker == hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()

    err, calls = _run(tmp_path, venv)  # nothing changed: no install, no message
    assert err == "" and calls == ["miles config x.toml"]

    with (repo / "pyproject.toml").open("a") as f:
        f.write("\n# a new dependency would go here\n")
    err, calls = _run(tmp_path, venv)
    assert "pyproject.toml changed" in err
    assert calls[0].startswith("pip install") and calls[-1] == "miles config x.toml"


def test_relative_paths_resolve_in_the_callers_directory(tmp_path: Path) -> None:
    """`../repo/miles.sh config sub/q.toml` from another directory reads ./sub/q.toml (the script
    does not move to the repository), through the real `miles` command."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "miles.sh", repo / "miles.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    real = venv / "bin" / "miles"
    real.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m miles.launch.cli "$@"\n')
    real.chmod(0o755)
    (venv / ".miles-installed").write_text(hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest())
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "q.toml").write_text('[run]\nname = "from_the_callers_dir"\n')
    p = subprocess.run(["bash", "../repo/miles.sh", "config", "sub/q.toml"], capture_output=True, text=True,
                       timeout=50, cwd=work, env={**os.environ, "MILES_VENV": str(venv)})
    assert p.returncode == 0, p.stderr
    assert 'name = "from_the_callers_dir"' in p.stdout
