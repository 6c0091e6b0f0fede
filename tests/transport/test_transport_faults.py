"""The transport's fault hook (transport/faults.py): off by default, seeded, and on loopback a
dropped ask or reply fails its asker at the deadline, a dropped tell never arrives, a delay loses nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from echo_host import Count, Echo, EchoActor, GetCount

from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import Host
from miles.core.errors import ConfigError, PeerTimeout
from miles.core.schema.transport import FaultConfig, TransportConfig
from miles.transport import codec
from miles.transport.faults import FaultHook

pytestmark = pytest.mark.timeout(60)


def _cfg(**faults: object) -> TransportConfig:
    return TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0,
                           faults=FaultConfig(**faults))  # type: ignore[arg-type]


@dataclass
class Pair:
    server: Host
    client: Host


async def _pair(server_faults: dict[str, object], client_faults: dict[str, object]) -> Pair:
    """Two hosts in this process on real loopback TCP: the server runs the directory and 'echo'."""
    server = Host(_cfg(**server_faults))
    await server.start()
    await server.add(Directory(), "directory")
    await server.add(EchoActor(), "echo")
    client = Host(_cfg(**client_faults), server.address)
    await client.start()
    return Pair(server, client)


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    server_faults, client_faults = request.param
    p = await _pair(server_faults, client_faults)
    try:
        yield p
    finally:
        await p.client.stop(grace_s=1.0)
        await p.server.stop(grace_s=1.0)


def test_off_by_default_and_validated() -> None:
    assert FaultHook.from_config(FaultConfig()) is None
    assert Host(TransportConfig()).faults is None
    assert FaultHook.from_config(FaultConfig(delay_rate=0.5)) is None  # no delay_ms: nothing to do
    with pytest.raises(ConfigError, match="transport.faults.drop_rate"):
        FaultConfig(drop_rate=1.5)
    with pytest.raises(ConfigError, match="transport.faults.delay_ms"):
        FaultConfig(delay_rate=0.1, delay_ms=-1)
    with pytest.raises(ConfigError, match="transport.faults.drop_limit"):
        FaultConfig(drop_rate=1.0, drop_limit=-1)


def test_drop_limit_drops_exactly_the_first_n_of_its_types() -> None:
    h = FaultHook(FaultConfig(drop_rate=1.0, drop_types=["t.Echo"], drop_limit=2), 1)
    got = [h.draw(codec.ASK, t) for t in ("t.Count", "t.Echo", "t.Count", "t.Echo", "t.Echo", "t.Echo")]
    assert got == [0.0, None, 0.0, None, 0.0, 0.0]
    assert h.dropped == {"ask:t.Echo": 2}


def test_draws_are_seeded_and_follow_the_configuration() -> None:
    cfg = FaultConfig(drop_rate=0.2, drop_types=["t.Echo"], delay_rate=0.5, delay_ms=40, seed=7)

    def draws(c: FaultConfig, stream: int = 1) -> list[float | None]:
        h = FaultHook(c, stream)
        return [h.draw(codec.ASK, "t.Echo") for _ in range(2000)]

    a = draws(cfg)
    assert a == draws(cfg)  # same seed, same stream: the same faults
    assert a != draws(FaultConfig(**{**cfg.__dict__, "seed": 8}))
    assert a != draws(cfg, stream=2)
    dropped = sum(d is None for d in a)
    assert 300 <= dropped <= 500, dropped  # 2000 x 0.2
    delays = [d for d in a if d]
    assert 700 <= len(delays) <= 900 and max(delays) <= 0.040, (len(delays), max(delays))
    other = FaultHook(cfg, 1)
    assert all(other.draw(codec.TELL, "t.Count") is not None for _ in range(500))  # not in drop_types
    assert not other.dropped and sum(other.delayed.values()) > 0
    beats = FaultHook(cfg, 1)
    assert all(beats.draw(codec.TELL, "t.Echo", may_delay=False) in (None, 0.0) for _ in range(200))


@pytest.mark.parametrize("pair", [({}, {"drop_rate": 0.3, "drop_types": ["t.Echo", "t.Count"], "seed": 3})],
                         indirect=True)
async def test_dropped_asks_fail_at_their_deadline_and_dropped_tells_never_arrive(pair: Pair) -> None:
    ref = pair.client.ref("echo")
    got = await asyncio.gather(*(ref.ask(Echo(f"m{i}"), timeout=0.5) for i in range(40)),
                               return_exceptions=True)
    hook = pair.client.faults
    assert hook is not None
    lost = [g for g in got if isinstance(g, BaseException)]
    assert all(isinstance(g, PeerTimeout) for g in lost), lost
    # Every lost ask is one the hook dropped; every other one was answered, and correctly.
    assert len(lost) == hook.dropped["ask:t.Echo"] > 0
    assert [g.text for g in got if isinstance(g, Echo)] == [f"m{i}"[::-1] for i in range(40)
                                                            if not isinstance(got[i], BaseException)]
    for _ in range(50):
        await ref.tell(Count(1))
    # GetCount is not in drop_types: it always arrives, after the tells (one ordered connection).
    assert await ref.ask(GetCount(), timeout=5) == 50 - hook.dropped["tell:t.Count"]
    assert 0 < hook.dropped["tell:t.Count"] < 50


@pytest.mark.parametrize("pair", [({"drop_rate": 1.0, "drop_types": ["t.Echo"]}, {})], indirect=True)
async def test_a_dropped_reply_counts_as_its_request_and_fails_the_asker(pair: Pair) -> None:
    ref = pair.client.ref("echo")
    with pytest.raises(PeerTimeout, match="within"):
        await ref.ask(Echo("lost answer"), timeout=0.5)
    hook = pair.server.faults
    assert hook is not None and dict(hook.dropped) == {"reply:t.Echo": 1}  # the handler ran
    assert await ref.ask(GetCount(), timeout=5) == 0  # other types still answered


@pytest.mark.parametrize("pair", [({"delay_rate": 1.0, "delay_ms": 20}, {"delay_rate": 1.0, "delay_ms": 20})],
                         indirect=True)
async def test_delays_lose_nothing(pair: Pair) -> None:
    ref = pair.client.ref("echo")
    got = await asyncio.gather(*(ref.ask(Echo(f"d{i}"), timeout=10) for i in range(30)))
    assert [g.text for g in got] == [f"d{i}"[::-1] for i in range(30)]
    for i in range(20):
        await ref.tell(Count(i))
    assert await ref.ask(GetCount(), timeout=10) == sum(range(20))
    assert pair.client.faults is not None and pair.server.faults is not None
    assert not pair.client.faults.dropped and not pair.server.faults.dropped
    assert pair.client.faults.delayed["ask:t.Echo"] == 30 and pair.client.faults.delayed["tell:t.Count"] == 20
    assert pair.server.faults.delayed["reply:t.Echo"] == 30
