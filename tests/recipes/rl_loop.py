"""A minimal in-process RL loop for recipe tests: torch engine rollouts -> FSDPTrainer -> sync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.deterministic import request_seed
from miles.trainer.fsdp import FSDPTrainer


def prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, 7))).tolist() for _ in range(count)]


async def rollout(
    engine: TorchEngine,
    ps: list[list[int]],
    n: int,
    *,
    run_seed: int,
    step: int,
    max_new: int = 6,
    temperature: float = 1.0,
    routes: bool = False,
) -> list[GenerateResult]:
    reqs = [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(
                temperature=temperature,
                max_new_tokens=max_new,
                seed=request_seed(run_seed, step, i, j),
            ),
            return_routed_experts=routes,
        )
        for i, p in enumerate(ps)
        for j in range(n)
    ]
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def even_reward(ids: list[int]) -> float:
    return float(np.mean([t % 2 == 0 for t in ids]))


def to_batch(
    ps: list[list[int]],
    results: list[GenerateResult],
    n: int,
    reward: Callable[[list[int]], float] = even_reward,
) -> TrainBatch:
    out = []
    for k, r in enumerate(results):
        out.append(
            TrainSample(
                prompt_ids=np.asarray(ps[k // n]),
                response_ids=np.asarray(r.output_ids),
                reward=reward(r.output_ids),
                group_index=k // n,
                rollout_logprobs=np.asarray(r.logprobs, np.float32),
                versions=np.asarray(r.versions, np.int64),
                routed_experts=r.routed_experts,
            )
        )
    return TrainBatch(out)


async def sync(trainer: FSDPTrainer, engine: TorchEngine, version: int) -> int:
    """Push the trainer's weights (or only what `export` yields) to the engine; returns bytes."""
    named = [(k, v.detach().clone()) for k, v in trainer.export_hf_state()]
    await engine.stage(version, named)
    await engine.commit(version)
    return sum(v.numel() * v.element_size() for _, v in named)
