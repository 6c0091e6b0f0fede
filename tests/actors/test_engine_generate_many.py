"""engine.GenerateMany over a real engine actor: one reply per request, a bad request fails alone.

The rollout sends a group's samples as one GenerateMany; a request that fails must fail only
its own trajectory (its reply carries the error, which the rollout raises as the same type a
plain Generate would have raised), never its group's other samples.
"""

from __future__ import annotations

import pytest

from miles.actors.engine import EngineActor
from miles.actors.messages import GenerateMany
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.errors import EngineError, RemoteError
from miles.core.generation import GenerateFailed, GenerateResult
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(60)


def _sampling(n: int, **extra: object) -> dict[str, object]:
    return {"temperature": 1.0, "max_new_tokens": n, "stop_token_ids": [], "seed": 1, **extra}


async def test_generate_many_answers_each_request_and_isolates_a_bad_one() -> None:
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    head = Host(cfg)
    await head.start()
    await head.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    client = Host(cfg, directory=head.address)  # a second host: the messages cross a socket
    await client.start()
    try:
        spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=128))
        engine = TorchEngine(build_model(spec, seed=0), EngineConfig(max_batch_size=8, max_seq_len=256))
        await head.add(EngineActor(engine), "engine-0")
        prompt = [5, 6, 7, 8]
        msg = GenerateMany([prompt, prompt, [9, 10]],
                           [_sampling(3), _sampling(3, bogus=1), _sampling(2)])
        replies = await client.ref("engine-0").ask(msg, timeout=30)
        assert len(replies) == 3
        ok = [replies[0], replies[2]]
        assert all(isinstance(r, GenerateResult) for r in ok)  # typed records, decoded and checked
        assert [len(r.output_ids) for r in ok] == [3, 2]
        assert [len(r.logprobs) for r in ok] == [3, 2]
        assert all(r.finish_reason == "length" and not r.retracted for r in ok)
        failed = replies[1]
        assert isinstance(failed, GenerateFailed)
        assert failed.error_type == "EngineError" and "bogus" in failed.error
        err = failed.exception()
        assert isinstance(err, EngineError) and "bogus" in str(err)
        with pytest.raises(EngineError, match="2 prompts for 1 samplings"):
            await client.ref("engine-0").ask(GenerateMany([prompt, prompt], [_sampling(1)]), timeout=30)
    finally:
        await client.stop()
        await head.stop()


def test_an_unknown_remote_error_type_stays_a_remote_error() -> None:
    err = GenerateFailed("ZeroDivisionError", "division by zero").exception()
    assert isinstance(err, RemoteError) and err.type_name == "ZeroDivisionError"
