"""Synthetic rollout batches for tests and benchmarks, recorded by a model acting as the engine.

Each trajectory is scored by one unpacked forward of `engine_model` (B = 1, plain causal,
as an engine's prefill would run it): the logprobs of the response tokens under the
shared `token_logprobs` definition and, for MoE models, the routed experts of every
position except the last (which an engine never feeds back).
"""

from __future__ import annotations

import numpy as np
import torch

from miles.models.decoder import CausalLM
from miles.models.logprobs import token_logprobs
from miles.models.moe import compact_expert_ids
from miles.trainer.batch import TrainBatch, TrainSample


@torch.no_grad()
def engine_batch(
    engine_model: CausalLM,
    *,
    groups: int,
    group_size: int,
    prompt_len: tuple[int, int] = (4, 9),
    response_len: tuple[int, int] = (3, 9),
    temperature: float = 1.0,
    seed: int = 0,
    record_routes: bool = True,
) -> TrainBatch:
    """`groups` x `group_size` trajectories with random tokens and rewards in {0, 1}."""
    spec = engine_model.spec
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(0, spec.vocab_size, int(rng.integers(*prompt_len)))
        for _ in range(group_size):
            resp = rng.integers(0, spec.vocab_size, int(rng.integers(*response_len)))
            ids = torch.from_numpy(np.concatenate([prompt, resp])).long().unsqueeze(0)
            out = engine_model(ids, return_routed_experts=spec.is_moe and record_routes)
            p = prompt.size
            lp = token_logprobs(out.logits[0, p - 1 : -1], ids[0, p:], temperature)
            routes = None
            if out.routed_experts is not None:
                routes = compact_expert_ids(out.routed_experts[0, :-1], spec.num_experts)
            samples.append(
                TrainSample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    reward=float(rng.integers(0, 2)),
                    group_index=g,
                    rollout_logprobs=lp.numpy(),
                    routed_experts=routes,
                    versions=np.zeros(resp.size, np.int64),
                    temperature=temperature,
                )
            )
    return TrainBatch(samples)
