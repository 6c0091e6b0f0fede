"""In-process pipeline: buffer work items run through the layers and the session store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from miles.rollout.buffer import P, RolloutBuffer, Work
from miles.rollout.envs import arithmetic
from miles.rollout.filters import dynamic_sampling
from miles.rollout.layers import RolloutContext, default_generate, generate_one, single_turn_agent
from miles.rollout.tito.client import LocalSessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer

from .scripted_policy import ScriptedPolicy


async def test_buffer_driven_by_generate_one(tmp_path: Path) -> None:
    tok = tiny_tokenizer(tmp_path)
    client = LocalSessionClient(SessionStore(tok), ScriptedPolicy(tok, wrong_every=3))
    env = arithmetic.make_env(seed=2)
    ctx = RolloutContext(client, default_generate, single_turn_agent, env.reward, n_samples=2)
    buf = RolloutBuffer(capacity=3, n_samples=2, max_staleness=2, filter_fn=dynamic_sampling, batch_groups=2,
                        prompt_source=env.prompts.next, schedule="arrival")
    running: dict[asyncio.Task, Work] = {}

    def launch(works: list[Work]) -> None:
        for w in works:
            running[asyncio.ensure_future(generate_one(ctx, w.prompt, w.sample_index))] = w

    launch(buf.fill())
    trained = []
    version = 0
    while len(trained) < 4:
        done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            launch(buf.finish(running.pop(t), t.result()))
        if buf.ready(2):
            groups = buf.collect(2, version)
            trained += groups
            version += 1
            m = buf.step_metrics(version)
            assert m[P + "queue_size"] >= 0
    for t in running:
        t.cancel()
    for g in trained:
        assert len(g) == 2 and len(set(g.rewards)) == 2  # dynamic sampling kept only mixed groups
        for s in g.samples:
            assert s.prompt_ids and s.num_sampled >= 2 and s.metadata["response"]
    assert buf.ledger.counts()["trained"] == len(trained)
    assert buf.ledger.dropped_by_reason["zero_std"] >= 1
