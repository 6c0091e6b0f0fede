"""The rollout orchestration as a plain class, driven without sockets.

The engines are a link over the tests' scripted policy (tests/rollout/scripted_policy.py):
real orchestrator, buffer, session store, dispatch and request batching; only the model
is scripted. Covered: groups routed whole and their keys released, an engine that dies
(its requests go to the other engine without failing a trajectory, and it is used again
once up), retract/resubmit, sync admission (nothing of the next batch before the update),
eval draining, and the buffer's configured capacity kept.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from miles.core.config import load_config
from miles.core.errors import ActorDeadError, StartupError
from miles.core.generation import GenerateFailed, GenerateResult
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.rollout.orchestrator import Orchestrator
from miles.rollout.routing.dispatch import Dispatch
from miles.rollout.routing.requests import EngineRequests, Request
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.tokens.tokenizer import Tokenizer

from .scripted_policy import ScriptedPolicy

pytestmark = pytest.mark.timeout(60)
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
ENGINES = ["engine-0", "engine-1"]


class ScriptedLink:
    """Engines over the scripted policy. `dead`: engines whose asks fail as a dead actor's do;
    `retract_first`: the first reply to each prompt is retracted after one token."""

    def __init__(self, tok: Tokenizer, retract_first: bool = False) -> None:
        self.policy = ScriptedPolicy(tok)
        self.dead: set[str] = set()
        self.restarting: set[str] = set()  # engines whose server is down: each request fails alone
        self.retract_first = retract_first
        self.seen: set[tuple[int, ...]] = set()
        self.served: list[tuple[str, tuple[int, ...]]] = []  # (engine, prompt ids) per request
        self.messages: list[tuple[str, int]] = []  # (engine, requests in the message)
        self.version = 0  # the engines' weight version (the tests' trainer publishes each one at once)
        self.ended: list[tuple[str, str]] = []  # (engine, session key) per EndSession

    async def generate(self, engine: str, batch: list[Request]) -> list[GenerateResult | GenerateFailed]:
        await asyncio.sleep(0)
        if engine in self.dead:
            raise ActorDeadError(f"actor {engine!r} died: killed by the test")
        self.messages.append((engine, len(batch)))
        out: list[GenerateResult | GenerateFailed] = []
        for q in batch:
            if engine in self.restarting:  # as the engine actor answers a GenerateMany item
                out.append(GenerateFailed("EngineDown", f"{engine}: sglang server died; restarting"))
                continue
            self.served.append((engine, tuple(q.input_ids)))
            r = await self.policy(q.input_ids, q.sampling)
            ids, lps = r.ids[: q.sampling["max_new_tokens"]], r.logprobs[: q.sampling["max_new_tokens"]]
            retract = self.retract_first and tuple(q.input_ids) not in self.seen and len(ids) > 1
            self.seen.add(tuple(q.input_ids))
            if retract:
                ids, lps = ids[:1], lps[:1]
            out.append(GenerateResult(f"req-{len(self.served)}", ids, lps, "abort" if retract else "stop",
                                      [self.version] * len(ids), len(q.input_ids), 0, retracted=retract))
        return out

    async def end_session(self, engine: str, key: str) -> None:
        self.ended.append((engine, key))


def _orchestrator(tmp_path: Path, *sets: str, retract_first: bool = False
                  ) -> tuple[Orchestrator, ScriptedLink, list[str]]:
    cfg = load_config(MilesConfig, QUICKSTART, ["rollout.n_samples_per_prompt=4", "buffer.batch_groups=2",
                                                "buffer.capacity=16", "rollout.max_new_tokens=6", *sets])
    tok = tiny_tokenizer(tmp_path)
    link = ScriptedLink(tok, retract_first)
    downs: list[str] = []
    requests = EngineRequests(link, Dispatch(ENGINES), {"temperature": 1.0, "max_new_tokens": 6},
                              live_wait_s=30.0, on_down=downs.append)
    env = resolve_hook(cfg.rollout.env, "rollout.env")(**cfg.rollout.env_args)
    return Orchestrator(cfg, env, SessionStore.from_config(cfg.rollout, tok), requests), link, downs


async def _collect(o: Orchestrator, version: int) -> list[Any]:
    assert isinstance(o.requests.link, ScriptedLink)
    o.requests.link.version = version
    o.set_version(version)
    groups, _ = await asyncio.wait_for(o.collect(2, version), 30)
    return groups


async def test_groups_go_whole_to_one_engine_and_their_keys_are_released(tmp_path: Path) -> None:
    o, link, _ = _orchestrator(tmp_path)
    o.start()
    try:
        for v in range(3):
            o.set_version(v)
            groups = await _collect(o, v)
            assert len(groups) == 2 and all(len(g.samples) == 4 for g in groups)
        # every message carried whole groups: 4 requests of one prompt (one GenerateMany per group)
        per_prompt = Counter(link.served)
        assert set(per_prompt.values()) <= {4, 8, 12}  # the same question may be drawn twice
        assert {e for e, _ in link.messages} == set(ENGINES)  # both engines used
        state = o.requests.dispatch.state()
        assert state["groups_split"] == 0 and state["groups_routed"] >= 6
        assert state["keys_held"] == len(o.buffer.groups_in_flight())  # ended groups hold no key
    finally:
        await o.stop()


async def test_a_dead_engine_gets_nothing_and_costs_no_attempt(tmp_path: Path) -> None:
    o, link, downs = _orchestrator(tmp_path)
    link.dead.add("engine-1")
    o.start()
    try:
        o.set_version(0)
        groups = await _collect(o, 0)
        assert len(groups) == 2
        assert downs == ["engine-1"]  # learned once, from the first failed ask
        d = o.requests.dispatch
        assert d.live == ["engine-0"] and d.counters.lost_to_down_engine > 0
        sent_after = len(link.served)
        assert all(e == "engine-0" for e, _ in link.served)  # the dead engine's asks never arrived
        led = o.buffer.ledger.dump()
        assert led["retried"] == 0 and not led["dropped_by_reason"], led  # no attempt used
        # it comes back: routed to again
        link.dead.clear()
        o.requests.engine_up("engine-1")
        o.set_version(1)
        await _collect(o, 1)
        await _collect(o, 1)
        assert any(e == "engine-1" for e, _ in link.served[sent_after:])
        assert d.counters.groups_split == 0
    finally:
        await o.stop()


async def test_a_retracted_request_is_continued_and_keeps_its_tokens(tmp_path: Path) -> None:
    o, link, _ = _orchestrator(tmp_path, retract_first=True)
    o.start()
    try:
        o.set_version(0)
        groups = await _collect(o, 0)
        assert o.requests.resubmits >= 8  # every first request of the batch's 8 samples
        for g in groups:
            for s in g.samples:
                assert len(s.response_ids) > 1 and len(s.rollout_logprobs) == len(s.response_ids)
                # the continuation's prompt was the first prompt + the retracted token
                assert (*s.prompt_ids, s.response_ids[0]) in link.seen
    finally:
        await o.stop()


async def test_sync_mode_generates_the_next_batch_only_after_the_update(tmp_path: Path) -> None:
    o, link, _ = _orchestrator(tmp_path, "buffer.mode=sync")
    assert o.buffer.capacity == 8  # one batch of slots (2 groups x 4) of the 16 configured
    o.start()
    try:
        await _collect(o, 0)
        for _ in range(200):  # let everything runnable run
            await asyncio.sleep(0)
        before = len(link.served)
        assert before == 8  # the one batch, nothing of the next
        o.set_version(1)
        await _collect(o, 1)
        assert len(link.served) == 16
    finally:
        await o.stop()


async def test_fully_async_keeps_the_configured_capacity(tmp_path: Path) -> None:
    o, _, _ = _orchestrator(tmp_path)
    assert o.buffer.capacity == 16


async def test_drain_waits_for_the_trajectories_in_flight_and_starts_none(tmp_path: Path) -> None:
    o, link, _ = _orchestrator(tmp_path)
    o.start()
    try:
        await asyncio.sleep(0)
        await o.drain()
        assert not o._tasks
        n = len(link.served)
        o.set_version(1)
        for _ in range(100):
            await asyncio.sleep(0)
        assert len(link.served) == n  # held while the engines evaluate
        o.resume()
        await _collect(o, 1)
    finally:
        await o.stop()


async def test_requests_failing_with_engine_down_go_to_the_other_engine(tmp_path: Path) -> None:
    o, link, downs = _orchestrator(tmp_path)
    link.restarting.add("engine-0")
    o.start()
    try:
        groups = await _collect(o, 0)
        assert all(s.status == "completed" for g in groups for s in g.samples)
        assert downs == ["engine-0"] and o.requests.dispatch.live == ["engine-1"]
        assert o.requests.dispatch.counters.lost_to_down_engine > 0
        assert o.buffer.ledger.dump()["retried"] == 0
    finally:
        await o.stop()


async def test_a_resumed_rollout_generates_only_after_the_trainer_announces_its_version(tmp_path: Path) -> None:
    o, link, _ = _orchestrator(tmp_path)
    o.start()
    try:
        for v in range(3):
            await _collect(o, v)
        state = o.dump()  # what a checkpoint after the step at version 2 holds
    finally:
        await o.stop()
    r, link, _ = _orchestrator(tmp_path)
    with pytest.raises(StartupError, match=r"ckpt/rollout_state.json: missing \['data'\]"):
        r.load({"buffer": state["buffer"]}, "ckpt/rollout_state.json")
    r.load(json.loads(json.dumps(state)), "ckpt/rollout_state.json")  # as the role restores it, from JSON
    r.start()
    try:
        for _ in range(200):
            await asyncio.sleep(0)
        assert link.served == []  # the engines still hold their start weights
        await _collect(r, 3)  # the trainer's resumed hand-off announces version 3
        assert link.served
        assert not r.buffer.ledger.dump()["drop_events"]  # nothing sampled too stale to train
    finally:
        await r.stop()


async def test_halt_ends_a_waiting_collect_with_stopping(tmp_path: Path) -> None:
    """A process that stops answers the batch it cannot complete (the host's drain waits for it)."""
    from miles.core.errors import Stopping

    o, link, _ = _orchestrator(tmp_path)
    link.dead.update(ENGINES)  # nothing will ever finish: the collect waits
    o.start()
    try:
        o.set_version(0)
        waiting = asyncio.create_task(o.collect(2, 0))
        # Nothing in collect awaits before its wait for a change, so a few turns of the loop (not
        # a clock) bring it there: the halt below must wake a collect that is already waiting.
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()
        o.halt()
        with pytest.raises(Stopping, match="the rollout is stopping: the batch for trainer version 0 ends with 0 of 2"):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(Stopping):  # and any later one
            await asyncio.wait_for(o.collect(2, 0), 10)
    finally:
        await o.stop()
