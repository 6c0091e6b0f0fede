"""The rollout's request routing (EngineRequests + Dispatch) over real engine actors: session
affinity, least-loaded placement of new keys, a dead engine taken out and its sessions moved."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from miles.actors.engine import EngineActor
from miles.actors.runtime.host import Host
from miles.bench.session_front import engine_requests
from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.torch_engine import TorchEngine
from miles.rollout.routing.requests import EngineRequests

from .session_stack import make_tok, start_host, start_stack, tiny_lm, transport_cfg

pytestmark = pytest.mark.timeout(90)
ENGINE_HOST = "tests/session/procs/session_engine_host.py"


def _sampling(n: int, seed: int = 1) -> dict[str, object]:
    return {"temperature": 1.0, "max_new_tokens": n, "stop_token_ids": [], "seed": seed}


async def _multi_turn(reqs: EngineRequests, vocab: int, sessions: int = 6, turns: int = 16) -> dict[int, list[str]]:
    """Sessions in lock-step rounds, each round's turns in flight together in a shuffled order (so,
    with affinity off, least-loaded placement scatters a session's turns); every turn sends the
    whole history plus two new tokens. Returns each session's engine after each turn (affinity on)."""
    rng = random.Random(0)
    ctx = {s: [rng.randrange(1, vocab) for _ in range(16)] for s in range(sessions)}
    where: dict[int, list[str]] = {s: [] for s in range(sessions)}

    async def turn(s: int, t: int) -> None:
        out = await reqs.call(f"wl-{s}", list(ctx[s]), _sampling(32, s * 1009 + t))
        ctx[s] += out.ids
        e = reqs.dispatch.policy.engine_of(f"wl-{s}")
        if e is not None:
            where[s].append(e)

    for t in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for s in order:
            ctx[s] += [rng.randrange(1, vocab) for _ in range(2)]
        await asyncio.gather(*(turn(s, t) for s in order))
    for s in range(sessions):
        reqs.dispatch.release(f"wl-{s}")
    return where


async def test_affinity_keeps_each_session_on_one_engine(tmp_path) -> None:
    tok = make_tok(tmp_path)
    for affinity in (True, False):
        s = await start_stack(tok, [tiny_lm(tok, seed=i) for i in range(3)], affinity=affinity)
        try:
            where = await _multi_turn(s.requests, tok.vocab_size)
            c = s.dispatch.counters
            assert c.groups_routed == 6 and sum(c.requests.values()) == 6 * 16
            if affinity:
                assert c.groups_split == 0
                for engines in where.values():  # every turn of a session on one engine
                    assert len(engines) == 16 and len(set(engines)) == 1
                # sessions spread over the engines (least-loaded placement of new keys)
                assert len({engines[0] for engines in where.values()}) == 3
            else:
                assert c.groups_split > 0  # some session's turns reached more than one engine
            assert s.dispatch.state()["keys_held"] == 0  # released keys are forgotten
        finally:
            await s.stop()


async def test_least_loaded_placement_and_affinity_over_load(tmp_path) -> None:
    tok = make_tok(tmp_path)
    s = await start_stack(tok, [tiny_lm(tok, seed=i) for i in range(2)])
    reqs, d = s.requests, s.dispatch
    try:
        first = await reqs.call("a", [5] * 20, _sampling(4))
        assert d.policy.engine_of("a") == "engine-0"  # both idle: the first registered engine
        # engine-0 busy with a long request: a new session goes to engine-1
        busy = asyncio.create_task(reqs.call("busy", [7] * 300, _sampling(400)))
        for _ in range(100):  # until the dispatch counts it in flight (not a fixed sleep: CI is loaded)
            if d.policy.stats()["engines"]["engine-0"]["in_flight_requests"]:
                break
            await asyncio.sleep(0.05)
        assert d.policy.engine_of("busy") == "engine-0"
        await reqs.call("b", [9] * 10, _sampling(4))
        assert d.policy.engine_of("b") == "engine-1"
        # affinity beats load: session "a" stays on the busy engine-0
        before = dict(d.counters.requests)
        await reqs.call("a", [5] * 20 + first.ids + [6, 6], _sampling(4))
        assert d.counters.requests["engine-0"] == before["engine-0"] + 1
        assert d.counters.requests["engine-1"] == before["engine-1"]
        await busy
        for key in ("a", "b", "busy"):
            d.release(key)
        assert d.counters.groups_routed == 3 and d.counters.groups_split == 0
    finally:
        await s.stop()


async def test_dead_engine_is_removed_and_its_sessions_move(procs, tmp_path) -> None:
    tok = make_tok(tmp_path)
    head = await start_host()  # the directory (and one local engine)
    rollout_host = Host(transport_cfg(), head.address)  # the rollout's own host watches for deaths
    await rollout_host.start()
    reqs = None
    try:
        # in a thread: this loop runs the directory the child registers with
        p, _ = await asyncio.to_thread(procs.spawn, [ENGINE_HOST, "--directory", head.address, "--name",
                                                     "remote-0", "--vocab", str(tok.vocab_size)])
        await head.add(EngineActor(TorchEngine(tiny_lm(tok), EngineConfig(max_seq_len=1024))), "local-0")
        reqs = engine_requests(rollout_host, ["remote-0", "local-0"], timeout_s=30)
        t1 = await reqs.call("sess", [3] * 12, _sampling(6))
        assert reqs.dispatch.policy.engine_of("sess") == "remote-0"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        await reqs.call("sess", [3] * 12 + t1.ids + [4], _sampling(6))
        # the session moved to the surviving engine (taken out by the death notice or the failed ask)
        st = reqs.dispatch.state()
        assert list(st["down"]) == ["remote-0"] and reqs.dispatch.live == ["local-0"]  # type: ignore[arg-type]
        assert reqs.dispatch.policy.engine_of("sess") == "local-0"
        assert st["downs"] == 1 and st["groups_moved"] == 1
        # the last engine gone: requests fail with a clear error once no engine came back in time
        reqs.engine_down("local-0", "removed by the test")
        reqs.live_wait_s = 0.2
        with pytest.raises(EngineError, match="no live engine"):
            await reqs.call("other", [1, 2], _sampling(2))
    finally:
        if reqs is not None:
            await reqs.close()
        await rollout_host.stop()
        await head.stop()
