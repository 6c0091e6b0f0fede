"""Liveness under stalls: a busy loop is not a death; a host declared dead that is alive rejoins."""

from __future__ import annotations

import asyncio
import time

import pytest
from echo_host import Block, Echo

from miles.actors.runtime.host import Host
from miles.actors.runtime.messages import DeathNotice, Lookup
from miles.core.errors import ActorDeadError, MilesError
from miles.core.schema.transport import TransportConfig

HOST = "tests/actors/procs/echo_host.py"
pytestmark = pytest.mark.timeout(60)


async def test_stalled_host_rejoins_with_a_new_incarnation(procs) -> None:
    _, directory = procs.spawn([HOST, "--run-directory"])
    # A stall bound of 0.5 s: the 3 s stall below silences the heartbeats and the host is declared dead.
    procs.spawn([HOST, "--directory", directory, "--name", "stall", "--stall-timeout", "0.5"])
    host = Host(TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0), directory)
    await host.start()
    notices: list[DeathNotice] = []
    host.on_death(notices.append)
    try:
        ref = host.ref("stall")
        assert (await ref.ask(Echo("ab"), timeout=5)).text == "ba"
        first = await host._directory_ask(Lookup("stall"))
        await ref.tell(Block(3.0))  # the loop stalls 3 s, three times the heartbeat timeout
        with pytest.raises(ActorDeadError):
            await ref.ask(Echo("during"), timeout=20)  # pending when the death is declared
        assert [n.host_id for n in notices] == [first.host_id]
        # The stalled host wakes, hears of its own death and registers again: same name, same address.
        deadline = time.monotonic() + 20
        while True:
            try:
                out = await ref.ask(Echo("again"), timeout=5)
                break
            except (ActorDeadError, MilesError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert out.text == "niaga"
        second = await host._directory_ask(Lookup("stall"))
        assert second.address == first.address
        assert second.host_id == first.host_id + "#2"
        # The old incarnation's answer to the ask that failed arrived late and was refused.
        t_end = time.monotonic() + 5
        while host.stale_replies < 1 and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        assert host.stale_replies >= 1
    finally:
        await host.stop()


async def test_a_loop_busy_for_seconds_is_not_declared_dead(procs) -> None:
    """Heartbeats come from a thread: 3 s of blocked loop (three heartbeat timeouts) is no death."""
    _, directory = procs.spawn([HOST, "--run-directory"])
    procs.spawn([HOST, "--directory", directory, "--name", "busy"])
    host = Host(TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0), directory)
    await host.start()
    notices: list[DeathNotice] = []
    host.on_death(notices.append)
    try:
        ref = host.ref("busy")
        await ref.tell(Block(3.0))
        out = await ref.ask(Echo("late"), timeout=20)  # answered once the loop is free again
        assert out.text == "etal"
        assert notices == []
    finally:
        await host.stop()
