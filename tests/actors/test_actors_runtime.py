"""Actor runtime across real processes and sockets: ask/tell, deadlines, errors, deaths, pub/sub."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import numpy as np
import pytest
from echo_host import Count, Echo, Fail, GetCount, Sleep, Sleeping

from miles.actors.runtime.actor import Actor
from miles.actors.runtime.host import Host
from miles.actors.runtime.messages import DeathNotice
from miles.core.errors import ActorDeadError, EngineError, PeerTimeout, ProtocolError
from miles.core.schema.transport import TransportConfig
from miles.transport.schema import message

HOST = "tests/actors/procs/echo_host.py"
pytestmark = pytest.mark.timeout(60)


def _cfg(scheme: str = "tcp") -> TransportConfig:
    return TransportConfig(scheme=scheme, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)


async def _client(directory: str, scheme: str = "tcp") -> Host:
    h = Host(_cfg(scheme), directory)
    await h.start()
    return h


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
async def test_ask_tell_across_processes(procs, scheme) -> None:
    _, directory = procs.spawn([HOST, "--run-directory", "--scheme", scheme])
    procs.spawn([HOST, "--directory", directory, "--name", "echo", "--scheme", scheme])
    host = await _client(directory, scheme)
    try:
        ref = host.ref("echo")
        arr = np.arange(50_000, dtype=np.float32)
        out = await ref.ask(Echo("abc", arr), timeout=5)
        assert out.text == "cba"
        np.testing.assert_array_equal(out.arr, arr * 2)
        for i in range(10):
            await ref.tell(Count(i))
        await ref.tell_many([Count(1) for _ in range(100)])
        assert await ref.ask(GetCount(), timeout=5) == 45 + 100
    finally:
        await host.stop()


async def test_deadline_and_remote_error(procs) -> None:
    _, directory = procs.spawn([HOST, "--run-directory", "--name", "echo"])
    host = await _client(directory)
    try:
        ref = host.ref("echo")
        with pytest.raises(PeerTimeout, match="within"):
            await ref.ask(Sleep(2.0), timeout=0.2)
        with pytest.raises(EngineError, match="asked to fail: because") as ei:
            await ref.ask(Fail("because"), timeout=5)
        assert "Traceback" in ei.value.remote_traceback  # type: ignore[attr-defined]
        with pytest.raises(ProtocolError, match="no handler"):
            await ref.ask(DeathNotice("h", [], "x"), timeout=5)
        assert (await ref.ask(Echo("ok"), timeout=5)).text == "ko"
    finally:
        await host.stop()


async def test_killed_peer_gives_actor_dead_error(procs) -> None:
    _, directory = procs.spawn([HOST, "--run-directory"])
    victim, _ = procs.spawn([HOST, "--directory", directory, "--name", "victim"])
    host = await _client(directory)
    notices: list[DeathNotice] = []
    host.on_death(notices.append)
    try:
        ref = host.ref("victim")
        assert (await ref.ask(Echo("x"), timeout=5)).text == "x"
        pending = asyncio.create_task(ref.ask(Sleep(30), timeout=20))
        # the ask is inside the victim's handler before the kill (not a fixed sleep: CI is loaded)
        deadline = asyncio.get_running_loop().time() + 10
        while await ref.ask(Sleeping(), timeout=5) < 1:
            assert asyncio.get_running_loop().time() < deadline, "the Sleep ask never arrived"
            await asyncio.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        # ActorDeadError, not the ask's own 20 s PeerTimeout: the death was heard first. How fast
        # (heartbeat timeout 1.0 s) is a timing: bench/deadlines_cpu.py measures it.
        with pytest.raises(ActorDeadError, match="victim"):
            await pending
        assert notices and "victim" in notices[0].names
        with pytest.raises(ActorDeadError):
            await ref.ask(Echo("x"), timeout=1)
    finally:
        await host.stop()


async def test_directory_wait_for(procs) -> None:
    _, directory = procs.spawn([HOST, "--run-directory"])
    host = await _client(directory)
    try:
        with pytest.raises(PeerTimeout, match="late"):
            await host.lookup("late", timeout=0.3)
        waiter = asyncio.create_task(host.lookup("late", timeout=20))
        # started off the loop: the waiter asks while "late" is still starting (a second or so)
        await asyncio.to_thread(procs.spawn, [HOST, "--directory", directory, "--name", "late"])
        loc = await waiter
        assert loc.name == "late" and loc.address.startswith("tcp://127.0.0.1:")
    finally:
        await host.stop()


@message("t.Version")
@dataclass
class Version:
    v: int


class Announcer(Actor):
    pass


async def test_pubsub_fan_out(procs) -> None:
    _, directory = procs.spawn([HOST, "--run-directory"])
    pub = await _client(directory)
    subs = [await _client(directory) for _ in range(3)]
    try:
        await pub.add(Announcer(), "announcer")
        got: list[list[int]] = [[] for _ in subs]
        heard: list[int] = [0 for _ in subs]
        for i, s in enumerate(subs):
            await s.subscribe("announcer", "weights", lambda m, i=i: got[i].append(m.v), timeout=5)
            await s.subscribe("announcer", "ping", lambda m, i=i: heard.__setitem__(i, 1), timeout=5)
        # PUB/SUB joins late ("slow joiner"): ping until every subscriber hears one. A subscription
        # reaches the publisher in the order it was made, so "weights" is in place by then too.
        for _ in range(500):
            if all(heard):
                break
            await pub.publish("ping", Version(-1))
            await asyncio.sleep(0.01)
        assert all(heard), heard
        for v in range(5):
            await pub.publish("weights", Version(v))
        for _ in range(100):
            if all(len(g) == 5 for g in got):
                break
            await asyncio.sleep(0.02)
        assert got == [[0, 1, 2, 3, 4]] * 3
    finally:
        for h in [pub, *subs]:
            await h.stop()
