"""The two ends of a `miles perftest` run: rank 0 drives and reports, rank 1 responds.

Rank 0 measures the reference limits, then runs the whole size sweep twice over the
same plan: first on the raw library (`transport/perf/raw.py`), then on the miles path
(`perftest/miles_runner.py`), telling rank 1 over the control link what to open.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from miles.core.errors import MilesError, PeerTimeout
from miles.core.slurm_env import SlurmEnv
from miles.transport.perf.control import Control, route_ip
from miles.transport.perf.limits import cuda_limits, host_limits
from miles.transport.perf.patterns import Plan, drive, make_plans, respond
from miles.transport.perf.raw import Ctx, make_raw
from miles.transport.perf.report import LatencyStats, ReportRow, table, write_csv, write_json


@dataclass
class Report:
    meta: dict[str, Any]
    rows: list[ReportRow]

    def emit(self, a: argparse.Namespace) -> None:
        if not a.quiet:
            m = self.meta
            print(f"# miles perftest: {m['transport']} {m['pattern']} on {m['device']}, window {m['window']}, "
                  f"limit = {m['limit_kind']}; latency is per message ({m['latency']})")
            print(table(self.rows), flush=True)
        if a.json:
            write_json(a.json, self.meta, self.rows)
        if a.csv:
            write_csv(a.csv, self.rows)
        if a.plot:
            from miles.perftest.plot import plot

            plot([{"meta": self.meta, "rows": [asdict(r) for r in self.rows]}], a.plot)


def _device(ctx: Ctx, rank: int, transport: str) -> str:
    if ctx.device in ("cpu", "pinned"):
        return ctx.device
    n = torch.cuda.device_count()
    # cuda-ipc: both ends on one GPU (trainer and engine share it); otherwise one GPU per rank.
    idx = 0 if transport == "cuda-ipc" else rank % max(1, n)
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def limit_kind(transport: str, device: str) -> str:
    """GPU memory: device-to-device copy; pinned host memory: the pinned host-to-device copy
    (where such bytes are headed); pageable host memory: memcpy."""
    if device.startswith("cuda"):
        return "d2d"
    return "h2d" if device == "pinned" else "memcpy"


async def _await_peer(ctl: Control, timeout_s: float) -> dict[str, Any]:
    """The hello of rank 1 (a local child that dies first fails at once, see `Control.peer_alive`)."""
    try:
        return await ctl.expect("hello", timeout_s)
    except PeerTimeout:
        raise PeerTimeout(f"perftest: no peer connected to {ctl.where} within {timeout_s:g} s "
                          "(start the other end with --peer HOST:PORT)") from None


async def run_driver(ctl: Control, a: argparse.Namespace, ctx: Ctx, sizes: list[int], max_bytes: int) -> Report:
    hello = await _await_peer(ctl, a.connect_timeout)
    ctx = replace(ctx, peer_host=str(hello["peer_host"]))
    ctx = replace(ctx, device=_device(ctx, 0, a.transport))
    window = 1 if a.transport == "cuda-ipc" else a.window  # one shared buffer: one message in flight
    plans = make_plans(a.pattern, sizes, a.iters, a.warmup, window, max_bytes)
    window = plans[0].block
    kind = limit_kind(a.transport, ctx.device)
    gpu = ctx.dev if ctx.dev.type == "cuda" else torch.device("cuda") if ctx.pinned else None
    limits = [cuda_limits(s, gpu) if gpu is not None else host_limits(s) for s in sizes]
    try:
        raw = await _raw_sweep(ctl, a.transport, ctx, plans)
        miles = await _miles_sweep(ctl, a.transport, a.pattern, ctx, plans)
    finally:
        await ctl.send("bye")
    rows = [ReportRow.build(a.transport, a.pattern, ctx.device, p.size, p.block, m, r, kind, lim)
            for p, m, r, lim in zip(plans, miles, raw, limits, strict=True)]
    meta = {"transport": a.transport, "pattern": a.pattern, "device": ctx.device, "window": window,
            "iters": a.iters, "warmup": a.warmup, "max_bytes": max_bytes, "limit_kind": kind,
            "latency": "send + ack round" if a.pattern == "pingpong" else "window time / messages",
            "nodes": [SlurmEnv.from_environ().node_name or platform.node(), hello.get("node", "")], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch": torch.__version__}
    return Report(meta, rows)


async def _raw_sweep(ctl: Control, transport: str, ctx: Ctx, plans: list[Plan]) -> list[LatencyStats]:
    link = make_raw(transport)
    info = await link.open(ctx)
    try:
        await ctl.send("open", flavor="raw", transport=transport, ctx=asdict(ctx), info=info,
                       plans=[p.to_wire() for p in plans])
        await asyncio.gather(link.connect(), ctl.expect("ready", ctx.timeout_s))
        stats = [await drive(link, p) for p in plans]
        await ctl.expect("done", ctx.timeout_s)
    finally:
        await link.close()
    return stats


async def _miles_sweep(ctl: Control, transport: str, pattern: str, ctx: Ctx, plans: list[Plan]) -> list[LatencyStats]:
    from miles.perftest.miles_runner import MilesDriver

    drv = MilesDriver(transport, pattern, ctx, block=plans[0].block)
    info = await drv.open()
    try:
        await ctl.send("open", flavor="miles", transport=transport, ctx=asdict(ctx), info=info, plans=[])
        await ctl.expect("ready", ctx.timeout_s)
        await drv.connect()
        stats = [await drive(drv, p) for p in plans]
        await drv.close_channel()
        await ctl.send("close")
        await ctl.expect("done", ctx.timeout_s)
    finally:
        await drv.stop()
    return stats


async def run_responder(connect: Callable[[], Control], host: str, timeout_s: float) -> int:
    ctl = connect()
    try:
        own_ip = route_ip(host, 9)
        node = SlurmEnv.from_environ().node_name or platform.node()
        await ctl.send("hello", timeout_s, peer_host=host, host=own_ip, node=node)
        idle_s = timeout_s
        waiting = "answer (is a perftest rank 0 listening there?)"
        while True:
            msg = await ctl.recv(idle_s, waiting)
            waiting = "instruction (is rank 0 still running?)"
            if msg["op"] == "bye":
                return 0
            if msg["op"] != "open":
                raise MilesError(f"perftest rank 1: unexpected '{msg['op']}' from rank 0")
            ctx = replace(Ctx(**msg["ctx"]), peer_host=host)
            ctx = replace(ctx, device=_device(ctx, 1, msg["transport"]))
            idle_s = max(ctx.timeout_s * 4, 120.0)  # rank 0 measures limits between phases
            try:
                await _respond_phase(ctl, msg, ctx, own_ip)
            except (MilesError, RuntimeError, OSError) as exc:
                await ctl.send("error", message=f"rank 1: {type(exc).__name__}: {exc}")
                raise
    finally:
        ctl.close()


async def _respond_phase(ctl: Control, msg: dict[str, Any], ctx: Ctx, own_ip: str) -> None:
    if msg["flavor"] == "raw":
        link = make_raw(msg["transport"])
        try:
            await link.open(ctx, msg["info"])
            await ctl.send("ready")
            await respond(link, [Plan.from_wire(p) for p in msg["plans"]])
            await ctl.send("done")
        finally:
            await link.close()
        return
    from miles.perftest.miles_runner import MilesResponder

    resp = MilesResponder(ctx, own_ip)
    try:
        await resp.open(msg["info"])
        await ctl.send("ready")
        await ctl.expect("close", max(ctx.timeout_s * 20, 600.0))
    finally:
        await resp.close()
    await ctl.send("done")
