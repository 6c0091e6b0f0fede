"""A session's turns reach its engine with the session key: the engine keeps the turn's KV and
the next turn prefills only its new tokens; closing the session (or releasing its routing key
when its group ends) sends EndSession, which frees that KV. Real engine actors over ZeroMQ,
the HTTP front on loopback."""

from __future__ import annotations

import asyncio
import signal

import pytest

from miles.actors.engine import EngineActor
from miles.actors.runtime.host import Host
from miles.bench.session_front import engine_requests
from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.torch_engine import TorchEngine

from .http_client import RemoteSessionClient
from .session_stack import make_tok, start_host, start_stack, tiny_lm, transport_cfg

pytestmark = pytest.mark.timeout(90)
ENGINE_HOST = "tests/session/procs/session_engine_host.py"


@pytest.fixture
async def stack(tmp_path):
    tok = make_tok(tmp_path)
    s = await start_stack(tok, [tiny_lm(tok, seed=0), tiny_lm(tok, seed=1)])
    yield s, tok
    await s.stop()


async def test_http_session_reuses_its_engine_kv_and_close_frees_it(stack) -> None:
    s, _ = stack
    client = RemoteSessionClient(s.url)
    try:
        sid = await client.create_session()
        msgs = [{"role": "user", "content": "What is 2+3?"}]
        sampling = {"max_new_tokens": 8, "temperature": 0.0}
        r1 = await client.chat(sid, msgs, sampling=sampling)
        engine_name = s.dispatch.policy.engine_of(sid)  # the routing key of a front session is its id
        assert engine_name is not None
        engine = s.engines[engine_name]
        assert r1["usage"]["cached_tokens"] == 0
        assert engine.stats()["cached_sessions"] == 1  # the turn's KV kept for the next one

        msgs += [r1["message"], {"role": "user", "content": "And 4+5?"}]
        r2 = await client.chat(sid, msgs, sampling=sampling)
        u1, u2 = r1["usage"], r2["usage"]
        # turn 2 extends turn 1's ids exactly (TITO), so the whole of turn 1 (prompt and reply,
        # every token fed) is reused and only the appended messages are prefilled
        assert u2["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"]
        assert u2["cached_tokens"] < u2["prompt_tokens"]
        st = engine.stats()
        assert st["prefix_cached_tokens"] == u2["cached_tokens"] and st["prompt_tokens"] == \
            u1["prompt_tokens"] + u2["prompt_tokens"]
        assert s.service.stats()["prefix_hit_rate"] > 0
        other = next(e for n, e in s.engines.items() if n != engine_name)
        assert other.stats()["requests"] == 0  # both turns on the session's pinned engine

        await client.close(sid)
        assert engine.stats()["cached_sessions"] == 0  # EndSession dropped the KV ...
        with pytest.raises(EngineError, match="unknown session"):
            await engine.end_session(sid)  # ... and the engine forgot the key
        assert s.requests.sessions == {} and s.requests.sessions_ended == 1
        assert s.dispatch.state()["keys_held"] == 0  # its routing key released with it
    finally:
        await client.aclose()


async def test_releasing_a_routing_key_ends_its_sessions_on_the_engine(stack) -> None:
    """A group's sessions share its routing key: sent together (one GenerateMany with their
    session keys), each keeps its own KV; the group's end (`release`) frees all of them."""
    s, tok = stack
    reqs = s.requests
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": []}
    prompts = {"sess-a": [5, 6, 7, 8, 9, 10], "sess-b": [11, 12, 13, 14, 15, 16]}
    outs = await asyncio.gather(*(reqs.call("group-1", ids, sampling, session=k) for k, ids in prompts.items()))
    engine = s.engines[s.dispatch.policy.engine_of("group-1") or ""]
    assert engine.stats()["cached_sessions"] == 2 and all(o.cached_tokens == 0 for o in outs)
    # each session's next turn reuses its own turn, not the other's
    nxt = [await reqs.call("group-1", ids + o.ids + [3], sampling, session=k)
           for (k, ids), o in zip(prompts.items(), outs, strict=True)]
    assert [o.cached_tokens for o in nxt] == [len(ids) + len(o.ids) for ids, o in zip(prompts.values(), outs,
                                                                                       strict=True)]
    assert set(reqs.sessions) == {"sess-a", "sess-b"}

    await reqs.release("group-1")
    assert engine.stats()["cached_sessions"] == 0 and reqs.sessions == {} and reqs.sessions_ended == 2
    assert reqs.end_session_failures == 0 and s.dispatch.state()["keys_held"] == 0


async def test_a_turn_the_engine_refused_leaves_nothing_to_end(stack) -> None:
    """A turn the engine refuses (its prompt exceeds max_seq_len) never made the engine keep the
    key: closing that session sends no EndSession, so nothing fails or is left behind."""
    s, _ = stack
    client = RemoteSessionClient(s.url)
    try:
        sid = await client.create_session()
        with pytest.raises(Exception, match="max_seq_len"):
            await client.chat(sid, [{"role": "user", "content": "7 " * 1200}], sampling={"max_new_tokens": 4})
        assert sum(s.dispatch.counters.requests.values()) == 1  # it reached an engine, which refused it
        await client.close(sid)
        assert s.requests.end_session_failures == 0 and s.requests.sessions_ended == 0
        assert s.requests.sessions == {} and s.dispatch.state()["keys_held"] == 0
    finally:
        await client.aclose()


async def test_a_session_moved_off_a_dead_engine_ends_on_the_live_one(procs, tmp_path) -> None:
    """The session's engine process is SIGKILLed: its next turn runs on the surviving engine with
    the session key (kept there from then on), and the session's end goes to that engine only."""
    tok = make_tok(tmp_path)
    head = await start_host()
    rollout_host = Host(transport_cfg(), head.address)  # the rollout's own host hears the death
    await rollout_host.start()
    reqs = None
    try:
        p, _ = await asyncio.to_thread(procs.spawn, [ENGINE_HOST, "--directory", head.address, "--name",
                                                     "remote-0", "--vocab", str(tok.vocab_size)])
        local = TorchEngine(tiny_lm(tok), EngineConfig(max_seq_len=1024))
        await head.add(EngineActor(local), "local-0")
        reqs = engine_requests(rollout_host, ["remote-0", "local-0"], timeout_s=30)
        sampling = {"max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": []}
        ids = [3] * 12
        t1 = await reqs.call("sess", ids, sampling, session="sess")
        assert reqs.dispatch.policy.engine_of("sess") == "remote-0"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        ids += t1.ids + [4]
        t2 = await reqs.call("sess", ids, sampling, session="sess")
        assert t2.cached_tokens == 0 and reqs.sessions["sess"].engines == {"local-0"}
        t3 = await reqs.call("sess", ids + t2.ids + [5], sampling, session="sess")
        assert t3.cached_tokens == len(ids) + len(t2.ids)  # reused on the engine it moved to
        await reqs.release("sess")
        assert reqs.sessions_ended == 1 and reqs.end_session_failures == 0
        assert local.stats()["cached_sessions"] == 0
    finally:
        if reqs is not None:
            await reqs.close()
        await rollout_host.stop()
        await head.stop()


@pytest.mark.parametrize("engine_sessions", [True, False])
async def test_in_process_sessions_reuse_their_engine_kv(stack, engine_sessions: bool) -> None:
    """A rollout worker's in-process session (LocalSessionClient, what agents use without the HTTP
    front) sends its id as the engine session key when given `end_session`: turn 2 prefills only
    what turn 1 did not feed, and close frees the KV. Without it every turn prefills it all."""
    from miles.rollout.tito.client import LocalSessionClient
    from miles.rollout.tito.store import SessionStore

    s, tok = stack

    async def engine_fn(ids, sampling, images=None, session=None):
        return await s.requests.call("group-in-process", ids, sampling, images, session)

    client = LocalSessionClient(SessionStore(tok), engine_fn,
                                s.requests.end_session if engine_sessions else None)
    sid = await client.create_session()
    sampling = {"max_new_tokens": 8, "temperature": 0.0}
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    r1 = await client.chat(sid, msgs, sampling=sampling)
    msgs += [r1["message"], {"role": "user", "content": "And 4+5?"}]
    r2 = await client.chat(sid, msgs, sampling=sampling)
    engine = s.engines[s.dispatch.policy.engine_of("group-in-process") or ""]
    u1, u2 = r1["usage"], r2["usage"]
    if engine_sessions:
        assert u2["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"] < u2["prompt_tokens"]
        assert engine.stats()["cached_sessions"] == 1
    else:
        assert u2["cached_tokens"] == 0 and engine.stats()["cached_sessions"] == 0
    await client.close(sid)
    assert engine.stats()["cached_sessions"] == 0 and s.requests.sessions == {}
    assert s.requests.sessions_ended == int(engine_sessions) and s.requests.end_session_failures == 0
