"""Routed experts from the engine: every token and MoE layer, and replaying them reproduces the logits."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.logprobs import token_logprobs


async def test_routed_experts_cover_every_token_and_replay_reproduces_logits(moe_engine: TorchEngine) -> None:
    model = moe_engine.model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42, 43]]
    reqs = [
        GenerateRequest(
            input_ids=p, return_routed_experts=True, session_key=f"k{i}",
            sampling=SamplingParams(temperature=1.0, max_new_tokens=6 + 3 * i, seed=i),
        )
        for i, p in enumerate(prompts)
    ]
    results = await asyncio.gather(*(moe_engine.generate(r) for r in reqs))
    spec = model.spec
    for p, res in zip(prompts, results, strict=True):
        t = len(p) + len(res.output_ids)
        re = res.routed_experts
        assert re is not None and re.dtype == np.uint8
        assert re.shape == (t, spec.num_moe_layers, spec.num_experts_per_tok)
        full = torch.tensor([p + res.output_ids])
        with torch.no_grad():
            live = model(full, return_routed_experts=True)
            replay = model(full, routed_experts=torch.from_numpy(re.astype(np.int64))[None])
        assert np.array_equal(live.routed_experts[0].numpy(), re)
        assert torch.allclose(replay.logits, live.logits, atol=1e-5)
        lp = token_logprobs(replay.logits[0, len(p) - 1 : -1], torch.tensor(res.output_ids), 1.0)
        assert torch.allclose(lp, torch.tensor(res.logprobs), atol=1e-4)

    # second turn: routing of the cached prefix comes from the session store
    first = results[0]
    turn2 = prompts[0] + first.output_ids + [3]
    res2 = await moe_engine.generate(
        GenerateRequest(input_ids=turn2, session_key="k0", return_routed_experts=True,
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=2))
    )
    assert res2.cached_tokens == len(turn2) - 1
    with torch.no_grad():
        live2 = model(torch.tensor([turn2 + res2.output_ids]), return_routed_experts=True)
    assert np.array_equal(live2.routed_experts[0].numpy(), res2.routed_experts)
