"""Run untrusted Python (model-written code) in a subprocess with time, memory and network limits.

What is enforced, and how:
- wall time: the child's whole process group is SIGKILLed at `timeout_s`;
- CPU time: RLIMIT_CPU (the kernel kills a busy loop even if this process stalls);
- memory: RLIMIT_AS (address space), so a large allocation raises MemoryError in the child;
- output: stdout/stderr go to files capped by RLIMIT_FSIZE, read back up to `max_output_bytes`;
- network: the child runs in fresh user + network namespaces (`unshare -rn`): no interface
  but a down loopback, so every connect fails. That needs util-linux's `unshare` and
  unprivileged user namespaces; where they are missing, `network = "deny"` refuses to run
  (a ConfigError at build time) and `network = "allow"` runs without that isolation;
- environment: `python -I` (no user site, no PYTHON* variables), an empty environment and a
  fresh temporary working directory, removed afterwards.
Not enforced: reads of world-readable files and the process count (RLIMIT_NPROC is per
user, not per sandbox). Code and data reach the child as files, never pickled.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles.core.errors import ConfigError

# Runs first in the child: apply the limits to itself, then execute the user's file as __main__.
_BOOT = """
import json, resource, sys
lim = json.loads(sys.argv[1])
def cap(which, value):
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))
cap(resource.RLIMIT_AS, lim["memory_bytes"])
cap(resource.RLIMIT_CPU, lim["cpu_s"])
cap(resource.RLIMIT_FSIZE, lim["output_bytes"])
cap(resource.RLIMIT_CORE, 0)
path = sys.argv[2]
sys.argv = [path]
sys.path[0:0] = ["."]
src = open(path).read()
del json, resource, lim, cap
exec(compile(src, path, "exec"), {"__name__": "__main__", "__file__": path})
"""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mib: int = 512
    max_output_bytes: int = 1 << 20
    network: Literal["deny", "allow"] = "deny"

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mib < 32 or self.max_output_bytes < 1:
            raise ConfigError(f"sandbox: need timeout_s > 0, memory_mib >= 32 and max_output_bytes >= 1, "
                              f"got {self.timeout_s}, {self.memory_mib}, {self.max_output_bytes}")
        if self.network == "deny" and not network_isolation_available():
            raise ConfigError(
                "sandbox: network = 'deny' needs `unshare -rn` (util-linux) and unprivileged user "
                "namespaces, which this machine lacks; enable them (sysctl kernel.unprivileged_userns_clone=1) "
                "or set network = 'allow' to run model code WITH network access")


@dataclass
class SandboxResult:
    returncode: int | None  # None when killed at the wall-time limit
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def network_isolation_available() -> bool:
    """True when `unshare -rn` can start a process here (checked once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script under `limits`; the result carries exit code and (capped) output."""
    lim = limits or SandboxLimits()
    isolate = lim.network == "deny"
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-") as tmp:
        d = Path(tmp)
        (d / "main.py").write_text(code)
        (d / "stdin.txt").write_text(stdin)
        params = json.dumps({"memory_bytes": lim.memory_mib << 20, "cpu_s": max(1, int(lim.timeout_s) + 1),
                             "output_bytes": lim.max_output_bytes})
        argv = [sys.executable, "-I", "-c", _BOOT, params, "main.py"]
        if isolate:
            argv = [shutil.which("unshare") or "unshare", "-rn", *argv]
        with open(d / "stdin.txt", "rb") as fin, open(d / "out.txt", "wb") as fout, \
                open(d / "err.txt", "wb") as ferr:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=fin, stdout=fout, stderr=ferr, cwd=tmp, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), lim.timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # also reaps anything the code left running in the background
                await proc.wait()

        def read(name: str) -> str:
            with open(d / name, "rb") as f:
                return f.read(lim.max_output_bytes).decode(errors="replace")

        return SandboxResult(None if timed_out else proc.returncode, read("out.txt"), read("err.txt"),
                             timed_out, isolate)
