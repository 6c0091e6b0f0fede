"""Launcher for a stock SGLang server (`python -m sglang.launch_server`, tested with 0.5.17).

Starts the server as a child process in its own process group and waits for `GET /health`
(200 once the scheduler is up) under a deadline. A server that exits or never answers
during its first start raises `EngineStartError` with the error lines of its own log: the
same config would fail the same way, so it is never restarted. Only a server that had
served is restarted after a crash (at most engine.sglang_max_restarts times), and a
restart that fails to start is final too. A restart loads the last committed weights
(`model_path` / `weight_version` are updated by the engine after every disk commit), so a
crash never rolls the served version back.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

from miles.core.clock import Deadline
from miles.core.errors import EngineError, EngineStartError
from miles.core.logging import get_logger
from miles.core.schema.engine import EngineConfig

log = get_logger("miles.engine.sglang")


def launch_args(cfg: EngineConfig, model_path: str, weight_version: int, context_length: int) -> list[str]:
    """The launch_server command line (0.5.17 flag names)."""
    py = cfg.sglang_python or sys.executable
    args = [
        py, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.sglang_host,
        "--port", str(cfg.sglang_port),
        "--base-gpu-id", str(cfg.sglang_base_gpu),
        "--tp-size", str(cfg.sglang_tp),
        "--dp-size", str(cfg.sglang_dp),
        "--mem-fraction-static", str(cfg.sglang_mem_fraction),
        "--dtype", cfg.dtype,
        "--context-length", str(context_length),
        "--max-running-requests", str(cfg.max_batch_size),
        # miles owns tokenization (TITO): the server takes and returns token ids only.
        "--skip-tokenizer-init",
        "--weight-version", str(weight_version),
    ]
    if cfg.sglang_return_routed_experts:
        args.append("--enable-return-routed-experts")
    return args + list(cfg.sglang_extra_args)


class SGLangServer:
    """One launched server process; `ensure_running` (re)starts it, `stop` ends it."""

    def __init__(self, cfg: EngineConfig, model_path: str, log_path: str | Path, context_length: int) -> None:
        self.cfg = cfg
        self.context_length = context_length
        self.model_path = model_path  # the engine moves this to each committed version's folder
        self.weight_version = 0
        self.url = f"http://{cfg.sglang_host}:{cfg.sglang_port}"
        self.log_path = Path(log_path)
        self.restarts = 0
        self.starts = 0  # processes launched (first start + restarts)
        self.served = False  # whether the running process answered /health
        self.failed: str | None = None  # why the server cannot be (re)started; set once
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The launched server's process id (it leads its own process group), None before a start."""
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    async def ensure_running(self, session: aiohttp.ClientSession) -> bool:
        """Start the server if it is not running; True when it was (re)started by this call.
        Raises EngineStartError when it cannot be (re)started: never a loop of failing starts."""
        async with self._lock:
            if self.failed is not None:
                raise EngineStartError(self.failed)
            if self.alive:
                return False
            try:
                return await self._restart(session)
            except EngineStartError as exc:
                self.failed = str(exc)  # final: every later call raises the same cause
                raise

    async def _restart(self, session: aiohttp.ClientSession) -> bool:
        """(Re)start the server: a first start, or a restart of a server that had served."""
        if self._proc is not None:
            code = self._proc.returncode
            if not self.served:
                raise EngineStartError(f"sglang server failed at start (exit code {code}) and is not "
                                       f"restarted{self._cause()}")
            if self.restarts >= self.cfg.sglang_max_restarts:
                raise EngineStartError(
                    f"sglang server exited with code {code} and has been restarted {self.restarts} times "
                    f"(engine.sglang_max_restarts){self._cause()}"
                )
            self.restarts += 1
            await self.stop(5.0)  # children of the crashed server still hold the GPU and the port
            log.warning("sglang_server_restart", code=code, restarts=self.restarts,
                        model_path=self.model_path, version=self.weight_version)
        self.served = False  # a restart must come up again before it counts as serving
        await self._start(session)
        self.served = True
        return True

    def _cause(self) -> str:
        """' (log: PATH): <the server's own error lines>' - last, where a one-line report keeps them."""
        lines = error_lines(self.log_path)
        where = f" (log: {self.log_path})"
        return f"{where}: {' | '.join(lines)}" if lines else where

    async def _start(self, session: aiohttp.ClientSession) -> None:
        if _port_taken(self.cfg.sglang_host, self.cfg.sglang_port) and not await self._port_freed():
            # Without this check a leftover server on the port would answer /health for ours.
            raise EngineStartError(f"port {self.cfg.sglang_port} on {self.cfg.sglang_host} is still in use after "
                                   f"{self.cfg.sglang_port_wait_s:g} s (engine.sglang_port_wait_s; another "
                                   "server?); stop it or set engine.sglang_port")
        args = launch_args(self.cfg, self.model_path, self.weight_version, self.context_length)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as f:
            f.write(f"\n{LAUNCH_MARK}{' '.join(args)}\n".encode())
            f.flush()
            self._proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=dict(os.environ), preexec_fn=_die_with_parent)
        self.starts += 1
        log.info("sglang_server_starting", pid=self._proc.pid, url=self.url, log=str(self.log_path))
        try:
            await wait_healthy(session, self.url, Deadline.after(self.cfg.sglang_startup_timeout_s), self)
        except EngineError as exc:
            await self.stop(5.0)  # a server that hangs in start-up is not left holding the GPU
            raise EngineStartError(f"{exc}{self._cause()}") from exc

    async def _port_freed(self) -> bool:
        """The port is taken: most often by the server of this engine role's previous incarnation,
        which got SIGTERM when that role died (`_die_with_parent`) and is still shutting down.
        Whether it is free within engine.sglang_port_wait_s."""
        log.warning("sglang_port_in_use_waiting", host=self.cfg.sglang_host, port=self.cfg.sglang_port,
                    wait_s=self.cfg.sglang_port_wait_s)
        deadline = Deadline.after(self.cfg.sglang_port_wait_s)
        while _port_taken(self.cfg.sglang_host, self.cfg.sglang_port):
            if deadline.expired():
                return False
            await asyncio.sleep(0.5)
        return True

    async def stop(self, timeout_s: float = 30.0) -> None:
        proc = self._proc
        if proc is None:
            return
        # The server forks scheduler/detokenizer children: signal the whole process group, also when
        # its leader has exited already (a child left behind would hold the GPU and the port).
        _killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)
        except TimeoutError:
            _killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when the engine process dies. The server runs
    in a session of its own (so `stop` can signal its whole group); without this an engine killed
    hard left it holding the GPU and the port, and the engine's restart then failed with 'port in
    use' (seen on the H200). Linux only; elsewhere the engine's own `stop` is the only cleanup."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


LAUNCH_MARK = "# miles launch: "
# The last line of a Python traceback ("AssertionError: ...", "torch.OutOfMemoryError: ..."), which
# is the cause; other error-looking lines only when no traceback ended.
_RAISED = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b[^:]*:")
_ERROR = re.compile(r"(error|exception|assert|CUDA|out of memory|killed)", re.IGNORECASE)


def error_lines(log_path: Path, most: int = 2) -> list[str]:
    """The server's own error lines from its most recent start in its log (newest last)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    run = [ln.strip() for ln in text.rsplit(LAUNCH_MARK, 1)[-1].splitlines()[1:]]  # this start's output
    raised = [ln for ln in run if _RAISED.match(ln)]
    hits = raised or [ln for ln in run if _ERROR.search(ln) and not ln.startswith(("File ", "Traceback"))]
    return [h[:400] for h in dict.fromkeys(hits[-most:])]


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, deadline: Deadline, server: SGLangServer | None = None
) -> None:
    """Poll GET /health until 200; fail early if the launched process exits."""
    last = "no answer yet"
    while not deadline.expired():
        if server is not None and server._proc is not None and server._proc.poll() is not None:
            raise EngineError(f"sglang server exited with code {server._proc.returncode} during start-up")
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(min(1.0, deadline.remaining()))
    raise EngineError(f"sglang server at {url} not healthy before the deadline ({last})")
