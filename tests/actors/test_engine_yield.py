"""trainer.pause_engines over real engine actors: engines hold still while the trainer
computes, continue where they stopped afterwards, and a dead engine only costs a warning."""

from __future__ import annotations

import asyncio

import pytest

from miles.actors.engine import EngineActor
from miles.actors.engine_yield import EngineYield
from miles.actors.messages import Generate
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(90)


async def test_engines_hold_still_during_the_phase_and_continue_after() -> None:
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    head = Host(cfg)
    await head.start()
    await head.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    client = Host(cfg, directory=head.address)  # the trainer's side: messages cross a socket
    await client.start()
    try:
        spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=128))
        engine = TorchEngine(build_model(spec, seed=0), EngineConfig(max_batch_size=4, max_seq_len=512))
        await head.add(EngineActor(engine), "engine-0")
        sampling = {"temperature": 0.0, "max_new_tokens": 300, "stop_token_ids": [], "seed": 1}
        alone = await client.ref("engine-0").ask(Generate([5, 6, 7], sampling), timeout=60)
        task = asyncio.create_task(client.ref("engine-0").ask(Generate([5, 6, 7], sampling), timeout=60))
        while engine.stats()["generated_tokens"] < 310:
            await asyncio.sleep(0.001)
        # "engine-1" was never started: its pause and resume fail, are counted, and do not raise
        yielder = EngineYield(lambda e, m, t: client.ref(e).ask(m, timeout=t), ["engine-0", "engine-1"],
                              enabled=True, timeout_s=2.0)
        async with yielder.during("train"):
            held = engine.stats()["generated_tokens"]
            await asyncio.sleep(0.2)  # fixed on purpose: a window in which nothing may happen
            assert engine.stats()["generated_tokens"] == held and not task.done()
        assert yielder.failures == 2
        res = await task
        assert res.output_ids == alone.output_ids  # continued where it stopped: same greedy ids
        off = EngineYield(lambda e, m, t: client.ref(e).ask(m, timeout=t), ["engine-1"], enabled=False)
        async with off.during("train"):
            pass
        assert off.failures == 0  # disabled: sends nothing
    finally:
        await client.stop()
        await head.stop()
