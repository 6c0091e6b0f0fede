"""No two folders of the package import each other, and no two files do either (the models/
layers do not import back through the FP8 contract, the actor runtime's modules depend downward
only); scripts/import_graph.py reads the sources' ASTs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


@pytest.mark.timeout(60)
def test_no_folder_import_cycle_and_no_models_circle() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "folder cycles (imports): 0" in out.stdout
    assert "folder edges the layout does not allow: 0" in out.stdout  # docs/ARCHITECTURE.md's table
    assert "diffusion -> launch" not in out.stdout
    file_cycles = out.stdout.split("file cycles (imports):")[1]
    assert "models.layers" not in file_cycles and "models.decoder" not in file_cycles, file_cycles
    # Every import counts, TYPE_CHECKING ones too: a cycle hidden from the interpreter is still one.
    assert file_cycles.split("\n")[0].strip() == "0", file_cycles
