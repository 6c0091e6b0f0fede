"""No two classes of the package share a name, and every file a docstring or comment names
exists (scripts/names_check.py reads the sources; a rename that leaves an old path behind, or a
second `SessionStore`, fails here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "names_check.py"


@pytest.mark.timeout(60)
def test_class_names_are_unique_and_named_files_exist() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "duplicate class names: 0" in out.stdout
    assert "named files that do not exist: 0" in out.stdout


@pytest.mark.timeout(60)
def test_a_stale_name_and_a_second_class_are_found(tmp_path: Path) -> None:
    # The checker on a copy of itself inside a made-up package: it must report both faults.
    pkg = tmp_path / "scripts"
    pkg.mkdir()
    (pkg / "names_check.py").write_text(SCRIPT.read_text())
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "a" / "one.py").write_text('"""Its shell is a/gone.py."""\n\nclass Same:\n    pass\n')
    (tmp_path / "b" / "two.py").write_text('"""See a/one.py."""\n\nclass Same:\n    pass\n')
    out = subprocess.run([sys.executable, str(pkg / "names_check.py"), "--check"], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Same: a/one.py:3, b/two.py:3" in out.stdout
    assert "a/one.py:1: a/gone.py" in out.stdout
    assert "named files that do not exist: 1" in out.stdout  # b/two.py names a/one.py, which exists
