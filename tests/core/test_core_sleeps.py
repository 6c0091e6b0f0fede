"""Tests wait on the condition, not on the clock (issue 46): scripts/sleep_check.py finds a fixed
sleep followed by an assert, lets one through only with its reason on the line, and fails when
more than 5 test files hold one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sleep_check.py"

BAD = '''import asyncio, time

async def test_bad(proc):
    proc.start()
    await asyncio.sleep(0.5)
    assert proc.ready
'''
JUSTIFIED = '''import time

def test_window(engine):
    n = engine.tokens
    time.sleep(0.2)  # fixed on purpose: a window in which no token may be generated
    assert engine.tokens == n
'''
# Not flagged: a sleep inside a poll loop, a sleep too short to be a wait, a sleep with no assert
# after it in its block, and a sleep whose assert sits in a nested function.
FINE = '''import asyncio, time

async def test_poll(proc):
    deadline = time.monotonic() + 10
    while not proc.ready:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    for _ in range(100):
        if proc.done:
            break
        time.sleep(0.1)
    await asyncio.sleep(0.01)
    assert proc.done

def test_trailing(proc):
    if proc.slow:
        time.sleep(1)
    assert proc.done

def test_nested(proc):
    time.sleep(1)
    def check():
        assert proc.done
'''


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
def test_the_repository_tests_wait_on_the_condition() -> None:
    out = check(SCRIPT.parents[1] / "tests")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unjustified sleeps: 0" in out.stdout


@pytest.mark.timeout(60)
def test_a_fixed_sleep_before_an_assert_is_found_and_a_reason_lets_it_through(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_bad.py").write_text(BAD)
    (tmp_path / "test_window.py").write_text(JUSTIFIED)
    (tmp_path / "test_fine.py").write_text(FINE)
    out = check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "sub/test_bad.py:5: sleep(0.5) before the assert at line 6; UNJUSTIFIED" in out.stdout
    assert ("test_window.py:5: sleep(0.2) before the assert at line 6; fixed on purpose: a window in which "
            "no token may be generated") in out.stdout
    assert "test_fine.py" not in out.stdout
    assert "files with a fixed sleep before an assert: 2 (at most 5)" in out.stdout
    assert "unjustified sleeps: 1" in out.stdout
    (tmp_path / "sub" / "test_bad.py").unlink()
    out = check(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_more_than_five_files_fail_even_with_reasons(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"test_w{i}.py").write_text(JUSTIFIED)
    out = check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "files with a fixed sleep before an assert: 6 (at most 5)" in out.stdout
    assert "unjustified sleeps: 0" in out.stdout
