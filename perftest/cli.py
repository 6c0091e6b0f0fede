"""`miles perftest`: benchmark one miles transport against its raw library and the hardware.

Two ends, rank 0 (listens, drives, reports) and rank 1 (connects, receives, acks):
  * default: this process is rank 0 and starts rank 1 as a local child process;
  * `srun -N2 -n2 miles perftest ...`: SLURM_PROCID picks the rank (read through
    `SlurmEnv`). Rank 0 binds a random port and writes `HOST PORT` to
    `<--rendezvous-dir>/.miles-perftest-<job>.<step>` (default dir: SLURM_SUBMIT_DIR, which
    must be shared by both nodes); rank 1 polls for that file. With `--port P` no file is
    used: rank 0 binds P and rank 1 connects to the job's first node at P (rank 0 must run there);
  * any other launcher: `--listen [HOST:]PORT` on one end, `--peer HOST:PORT` on the other.
Rank 1 takes every setting from rank 0. Per size the report gives the miles path's latency
p50/p99/max, bandwidth and messages/s, the raw baseline's, and a reference limit measured
on the spot (memcpy; on GPUs D2D, plus pinned H2D/D2H), with miles/raw and miles/limit ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError, MilesError, PeerTimeout, TransportError
from miles.core.slurm_env import SlurmEnv
from miles.transport.perf.control import Control
from miles.transport.perf.patterns import PATTERNS
from miles.transport.perf.sizes import parse_size, parse_sizes

TRANSPORTS = ("zmq-ctl", "zmq-bulk", "ucx", "broadcast", "cuda-ipc", "disk")
CUDA_OK = ("ucx", "broadcast", "cuda-ipc")
MAX_SIZE = 4 << 30  # the largest frame the miles wire accepts by default


def add_parser(sub: Any) -> None:
    p = sub.add_parser("perftest", help="benchmark a transport (miles vs raw vs hardware limit)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=TRANSPORTS, default="zmq-bulk")
    p.add_argument("--pattern", choices=PATTERNS, default="stream",
                   help="pingpong (send + ack), stream (--window in flight), bucket (weight-sync: stage+commit)")
    p.add_argument("--sizes", default="8B:64MiB:x4", help="sizes or ranges, e.g. 8B:1GiB:x4, 1KiB:8KiB:+1KiB, 64KiB")
    p.add_argument("--iters", type=int, default=1000, help="measured messages per size (capped by --max-bytes)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up messages per size (not measured)")
    p.add_argument("--window", type=int, default=16, help="messages in flight per ack (stream, bucket)")
    p.add_argument("--max-bytes", default="1GiB", help="cap on bytes moved per size (fewer iters for big sizes)")
    p.add_argument("--device", choices=("cpu", "pinned", "cuda"), default="cpu",
                   help="where both ends' buffers live: host, page-locked host (needs CUDA), GPU")
    p.add_argument("--json", default="", metavar="FILE")
    p.add_argument("--csv", default="", metavar="FILE")
    p.add_argument("--plot", default="", metavar="PNG", help="bandwidth and latency vs size (needs matplotlib)")
    p.add_argument("--dir", default="", help="directory both ends share (disk transport); default: a temp dir")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of every wait during a run [s]")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="how long to wait for the other end [s]")
    p.add_argument("--peer", default="", metavar="HOST:PORT", help="be rank 1 and connect to rank 0 there")
    p.add_argument("--listen", default="", metavar="[HOST:]PORT",
                   help="be rank 0 and wait for a --peer there (HOST defaults to 127.0.0.1; 0.0.0.0 for other nodes)")
    p.add_argument("--port", type=int, default=0, help="under srun: fixed rank-0 port instead of a rendezvous file")
    p.add_argument("--rendezvous-dir", default="", help="under srun: shared dir of the address file")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    p.set_defaults(fn=cmd_perftest)


def _hostport(text: str, flag: str, default_host: str = "") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = default_host, text
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} {text!r}: expected HOST:PORT with a port in 1..65535")
    return host, int(port)


def check_args(a: argparse.Namespace) -> None:
    for name in ("iters", "window"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name} {getattr(a, name)} must be >= 1")
    if a.warmup < 0:
        raise ConfigError(f"--warmup {a.warmup} must be >= 0")
    if a.timeout <= 0 or a.connect_timeout <= 0:
        raise ConfigError("--timeout and --connect-timeout must be > 0")
    if a.pattern == "bucket" and a.transport == "zmq-ctl":
        raise ConfigError("--pattern bucket needs a bulk transport (zmq-bulk, ucx, broadcast, cuda-ipc, disk); "
                          "zmq-ctl carries control messages")
    if a.transport == "cuda-ipc":
        if a.device == "pinned":
            raise ConfigError("--transport cuda-ipc moves GPU memory; --device pinned is for host transports")
        a.device = "cuda"
    if a.device == "cuda" and a.transport not in CUDA_OK:
        raise ConfigError(f"--device cuda: {a.transport} moves host memory; use one of {', '.join(CUDA_OK)}")


def check_available(transport: str, device: str) -> None:
    """Fail early, in one line, when this machine lacks what the transport needs."""
    if transport == "ucx":
        try:
            import ucxx  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--transport ucx needs the 'ucx' extra (pip install 'miles[ucx]'): {exc}") from exc
    if device in ("cuda", "pinned"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--transport {transport} --device {device} needs CUDA, and this machine has none "
                              "(install a CUDA build of torch on a GPU node)")


def size_limit(transport: str) -> int:
    from miles.perftest.miles_runner import ZMQ_CTL_LIMIT

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # Both ends hold a payload, a staging buffer and a copy-out buffer on one machine at worst.
    limit = min(MAX_SIZE, phys // 8)
    return min(limit, ZMQ_CTL_LIMIT) if transport == "zmq-ctl" else limit


def cmd_perftest(a: argparse.Namespace) -> int:
    from miles.core.logging import configure_logging

    configure_logging("error", json=True)
    import torch

    # One copy thread per end, as a transport's own copies run; torch's parallel copies would
    # fight the other end (and any neighbour) for the cores and measure that instead.
    torch.set_num_threads(1)
    if a.peer and a.listen:
        raise ConfigError("--peer and --listen exclude each other (one end listens, the other connects)")
    if a.peer:
        host, port = _hostport(a.peer, "--peer")
        from miles.perftest.roles import run_responder

        return asyncio.run(run_responder(lambda: Control.connect(host, port), host, a.connect_timeout))
    check_args(a)
    check_available(a.transport, a.device)
    sizes = parse_sizes(a.sizes, size_limit(a.transport))
    max_bytes = parse_size(a.max_bytes, "--max-bytes")
    env = SlurmEnv.from_environ()
    if a.listen:
        host, port = _hostport(a.listen, "--listen", "127.0.0.1")  # loopback unless a HOST is given
        return _drive(a, sizes, max_bytes, host, port, rendezvous=None, child=False)
    if env.in_step:
        if env.ntasks != 2:
            raise ConfigError(f"miles perftest under srun needs exactly 2 tasks (srun -N2 -n2), got {env.ntasks}")
        return _slurm(a, env, sizes, max_bytes)
    return _drive(a, sizes, max_bytes, "127.0.0.1", 0, rendezvous=None, child=True)


def _slurm(a: argparse.Namespace, env: SlurmEnv, sizes: list[int], max_bytes: int) -> int:
    from miles.perftest.roles import run_responder

    rdir = Path(a.rendezvous_dir or env.submit_dir or os.getcwd())
    rfile = rdir / f".miles-perftest-{env.job_id}.{env.step_id}"
    if env.proc_id == 0:
        return _drive(a, sizes, max_bytes, "0.0.0.0", a.port, rendezvous=None if a.port else rfile, child=False,
                      advertise=env.node_name or socket.gethostname())
    if a.port:
        host, port = env.hosts()[0], a.port
    else:
        host, port = _wait_rendezvous(rfile, a.connect_timeout)
    return asyncio.run(run_responder(lambda: Control.connect(host, port), host, a.connect_timeout))


def _wait_rendezvous(path: Path, timeout_s: float) -> tuple[str, int]:
    end = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > end:
            raise PeerTimeout(f"perftest rank 1: rank 0 wrote no address to {path} within {timeout_s:g} s "
                              "(is the directory shared by both nodes? see --rendezvous-dir, --port)")
        time.sleep(0.05)
    host, port = path.read_text().split()
    return host, int(port)


def _drive(a: argparse.Namespace, sizes: list[int], max_bytes: int, bind: str, port: int,
           rendezvous: Path | None, child: bool, advertise: str = "") -> int:
    from miles.perftest.roles import Report, run_driver

    tmp = None
    directory = a.dir
    if a.transport == "disk" and not directory:
        if not child:
            raise ConfigError("--transport disk across processes started apart needs --dir (a shared directory)")
        tmp = tempfile.TemporaryDirectory(prefix="miles-perftest-")
        directory = tmp.name
    ctl, port = Control.bind(bind, port)
    proc = None
    try:
        if rendezvous is not None:
            part = rendezvous.with_suffix(".tmp")
            part.write_text(f"{advertise} {port}\n")
            os.replace(part, rendezvous)
        if child:
            proc = subprocess.Popen([sys.executable, "-m", "miles.perftest.cli", "--peer",
                                     f"127.0.0.1:{port}", "--connect-timeout", str(a.connect_timeout)])
            ctl.peer_alive = lambda: proc is not None and proc.poll() is None
        # imported here: it brings torch, which no other `miles` command should pay for at start-up
        from miles.transport.perf.raw import Ctx

        ctx = Ctx(a.device, sizes[-1], a.timeout, bind_host=bind, directory=directory)
        report: Report = asyncio.run(run_driver(ctl, a, ctx, sizes, max_bytes))
    finally:
        ctl.close()
        if rendezvous is not None:
            rendezvous.unlink(missing_ok=True)
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if tmp is not None:
            tmp.cleanup()
    report.emit(a)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m miles.perftest.cli ...` (same as `miles perftest ...`)."""
    ap = argparse.ArgumentParser(prog="miles")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(["perftest", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.fn(args))
    except (MilesError, TransportError) as exc:
        print(f"miles perftest: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
