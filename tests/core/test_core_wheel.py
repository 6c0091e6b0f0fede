"""The built wheel (not the editable install) imports every subpackage in a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ["core", "core.schema", "transport", "transport.bulk", "actors", "actors.runtime",
               "engines", "models", "trainer", "rollout", "rollout.envs", "rollout.tokens", "rollout.tito", "rollout.routing",
               "rollout.rewards", "launch"]


@pytest.mark.timeout(300)
def test_wheel_installs_and_imports(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    (whl,) = wheels.glob("miles-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Dependencies come from the test's environment by a plain path entry (no .pth processing,
    # so the editable finder there stays inactive); miles itself comes only from the wheel.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site,
                    str(whl)], check=True, capture_output=True)
    code = (
        "import importlib, miles; "
        f"[importlib.import_module('miles.' + m) for m in {SUBPACKAGES!r}]; "
        "print(miles.__file__)"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip().startswith(site), out.stdout
    assert not (Path(site) / "miles" / "tests").exists()
