"""Shared pytest fixtures: owned child processes (stopped by PID) and test-process helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).resolve().parent

# Property tests judge the property, never the clock: no per-example deadline and no "too slow"
# health check (both tripped on a loaded 2-core runner: a timing assertion in disguise).
settings.register_profile("miles", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("miles")
sys.path.insert(0, str(TESTS / "actors" / "procs"))
sys.path.insert(0, str(TESTS))  # tests/numerics.py: `from numerics import ...` from any test folder

# One Inductor cache per test session, shared with the processes it starts. A cache left in /tmp
# by runs under another ATEN_CPU_CAPABILITY (CI's second pass, a user's earlier sweep) held CPU
# kernels that crashed this process when loaded (seen in tests/engines/test_engines_compile_cpu.py).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor = tempfile.mkdtemp(prefix="miles-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor
    atexit.register(shutil.rmtree, _inductor, True)


class Procs:
    """Starts child processes for one test and stops exactly those, by PID, at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.children: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], ready_timeout: float = 30.0, env: dict[str, str] | None = None,
              ready: bool = True) -> tuple[subprocess.Popen[bytes], str]:
        p, ready_file = self.start(args, env, ready)
        if not ready:
            return p, ""
        return p, self.wait_ready(p, ready_file, ready_timeout)

    def start(self, args: list[str], env: dict[str, str] | None = None,
              ready: bool = True) -> tuple[subprocess.Popen[bytes], str]:
        """Start a child without waiting for it: (process, its ready file, "" without one).
        Children started together import torch side by side instead of one after the other."""
        ready_file = str(self.tmp / f"ready-{len(self.children)}-{time.monotonic_ns()}") if ready else ""
        full = [sys.executable, *args] + (["--ready", ready_file] if ready else [])
        log = open(self.tmp / f"proc-{len(self.children)}.log", "wb")
        p = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
        self.children.append(p)
        return p, ready_file

    def wait_ready(self, p: subprocess.Popen[bytes], ready_file: str, ready_timeout: float = 30.0) -> str:
        """What a started child wrote to its ready file, once it is there."""
        args = p.args
        deadline = time.monotonic() + ready_timeout
        while not os.path.exists(ready_file):
            if p.poll() is not None:
                raise RuntimeError(f"process {args} exited with {p.returncode}: {self.log_of(p)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {args} not ready in {ready_timeout}s: {self.log_of(p)}")
            time.sleep(0.02)
        return Path(ready_file).read_text()

    def log_of(self, p: subprocess.Popen[bytes]) -> str:
        i = self.children.index(p)
        return (self.tmp / f"proc-{i}.log").read_text(errors="replace")[-4000:]

    def stop_all(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.children:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    pool = Procs(tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def miles_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MILES_CACHE for the session's launched runs. A warm-up checkpoint is cached under a
    hash of everything that shaped it (warmup/sft.py) and written atomically, so runs with the
    same warm-up share it, as a user's runs do: each warm-up trains once a session, not once a
    test (the tests of the cache itself, tests/launch/test_launch_warmup_cache.py, keep their own)."""
    return tmp_path_factory.mktemp("miles_cache")


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Each test logs at info level to its own captured stderr. An in-process CLI call or bench
    in an earlier test configures structlog with that test's stderr (closed afterwards) and its
    own level; without this, later tests' log calls fail or are filtered out."""
    from miles.core.logging import configure_logging

    configure_logging("info")
    yield
