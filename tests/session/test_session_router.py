"""Router actor over real engine actors: affinity, least-loaded placement, KV reuse hit rate, engine death."""

from __future__ import annotations

import asyncio
import signal

import pytest

from miles.actors.engine import EngineActor
from miles.actors.messages import EndSession, Generate, Stats
from miles.actors.router import RouterActor
from miles.actors.router_workload import MultiTurnWorkload, run_multi_turn
from miles.actors.runtime.host import Host
from miles.actors.session_messages import RemoveEngine, RouterStats
from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.torch_engine import TorchEngine

from .session_stack import make_tok, start_host, start_stack, tiny_lm, transport_cfg

pytestmark = pytest.mark.timeout(90)
ENGINE_HOST = "tests/session/procs/session_engine_host.py"


def _gen(ids: list[int], key: str | None, n: int) -> Generate:
    return Generate(ids, {"temperature": 1.0, "max_new_tokens": n, "stop_token_ids": [], "seed": 1}, key)


async def test_hit_rate_with_and_without_affinity(tmp_path) -> None:
    tok = make_tok(tmp_path)
    wl = MultiTurnWorkload(sessions=6, turns=16, vocab=tok.vocab_size)
    rates = {}
    for affinity in (True, False):
        s = await start_stack(tok, [tiny_lm(tok, seed=i) for i in range(3)], affinity=affinity)
        try:
            res = await run_multi_turn(s.host.ref("router"), wl)
            stats = await s.host.ref("router").ask(RouterStats(), timeout=5)
            assert stats["prefix_hit_rate"] == pytest.approx(res.prefix_hit_rate)
            rates[affinity] = res.prefix_hit_rate
            if affinity:
                for sess in range(wl.sessions):  # every turn of a session on one engine
                    assert len(set(res.engines_of(sess))) == 1
                # sessions spread over the engines (least-loaded placement of new keys)
                assert len({res.engines_of(sess)[0] for sess in range(wl.sessions)}) == 3
                # EndSession freed every session's KV on its engine
                for name in s.engines:
                    assert (await s.host.ref(name).ask(Stats(), timeout=5))["cached_sessions"] == 0
            else:
                assert any(len(set(res.engines_of(sess))) > 1 for sess in range(wl.sessions))
        finally:
            await s.stop()
    print(f"prefix hit rate: affinity {rates[True]:.4f}, no affinity {rates[False]:.4f}")
    assert rates[True] >= 0.98
    assert rates[False] < rates[True] - 0.1, rates


async def test_least_loaded_placement_and_affinity_over_load(tmp_path) -> None:
    tok = make_tok(tmp_path)
    s = await start_stack(tok, [tiny_lm(tok, seed=i) for i in range(2)])
    router = s.host.ref("router")
    try:
        first = await router.ask(_gen([5] * 20, "a", 4), timeout=30)
        assert first["engine"] == "engine-0"  # both idle: the first registered engine
        # engine-0 busy with a long request: a new session goes to engine-1
        busy = asyncio.create_task(router.ask(_gen([7] * 300, None, 400), timeout=60))
        for _ in range(100):  # until the router counts it in flight (not a fixed sleep: CI is loaded)
            st = await router.ask(RouterStats(), timeout=5)
            if st["engines"]["engine-0"]["in_flight_requests"]:
                break
            await asyncio.sleep(0.05)
        new = await router.ask(_gen([9] * 10, "b", 4), timeout=30)
        assert new["engine"] == "engine-1"
        # affinity beats load: session "a" stays on the busy engine-0 and reuses its KV there
        again = await router.ask(_gen([5] * 20 + first["output_ids"] + [6, 6], "a", 4), timeout=30)
        assert again["engine"] == "engine-0" and again["cached_tokens"] == 24
        assert (await busy)["engine"] == "engine-0"
        assert await router.ask(EndSession("a"), timeout=5) == 1
    finally:
        await s.stop()


async def test_dead_engine_is_removed_and_its_sessions_move(procs, tmp_path) -> None:
    tok = make_tok(tmp_path)
    head = await start_host()  # the directory (and one local engine)
    router_host = Host(transport_cfg(), head.address)  # the router's own host watches for deaths
    await router_host.start()
    try:
        # in a thread: this loop runs the directory the child registers with
        p, _ = await asyncio.to_thread(procs.spawn, [ENGINE_HOST, "--directory", head.address, "--name",
                                                     "remote-0", "--vocab", str(tok.vocab_size)])
        await head.add(EngineActor(TorchEngine(tiny_lm(tok), EngineConfig(max_seq_len=1024))), "local-0")
        router = RouterActor(["remote-0", "local-0"], engine_timeout_s=30)
        ref = await router_host.add(router, "router")
        t1 = await ref.ask(_gen([3] * 12, "sess", 6), timeout=30)
        assert t1["engine"] == "remote-0"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        t2 = await ref.ask(_gen([3] * 12 + t1["output_ids"] + [4], "sess", 6), timeout=30)
        # the session moved to the surviving engine; its KV was lost with the dead one
        assert t2["engine"] == "local-0" and t2["cached_tokens"] == 0
        stats = await ref.ask(RouterStats(), timeout=5)
        assert stats["removed"] == ["remote-0"] and list(stats["engines"]) == ["local-0"]
        assert router.policy.engine_of("sess") == "local-0"
        # the last engine gone: requests fail with a clear error
        await ref.ask(RemoveEngine("local-0"), timeout=5)
        with pytest.raises(EngineError, match="no engine"):
            await ref.ask(_gen([1, 2], None, 2), timeout=5)
    finally:
        await router_host.stop()
        await head.stop()
