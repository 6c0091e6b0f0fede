"""The workload of bench/engine.py, shared by every engine it times (torch engine, SGLang, HF).

Models and cases per device, the prompts of a case, the requests one timed run sends, and the
check that a run generated every token it was asked for. Every request is greedy unless the case
says otherwise and has no stop ids, so it runs to `new` tokens: the torch engine stops only on
the caller's stop ids, and SGLangEngine sends `ignore_eos` (engines/sglang_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.models.presets import tiny_config

MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "dense": tiny_config("qwen3", vocab_size=2048, hidden_size=128, intermediate_size=384,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        "moe": tiny_config("qwen3_moe", vocab_size=2048, hidden_size=128, intermediate_size=384,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64),
    },
    "cuda": {  # Qwen2.5-0.5B-shaped dense; a small Qwen3-MoE
        "dense": tiny_config("qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             head_dim=64, tie_word_embeddings=True, rope_theta=1e6),
        "moe": tiny_config("qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                           head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256),
    },
}


@dataclass(frozen=True)
class Case:
    prompts: int  # distinct prompts
    samples: int  # requests per prompt (a GRPO group's n)
    prompt: int  # tokens per prompt
    new: int  # tokens generated per request
    temperature: float = 0.0  # 0 = greedy
    seeded: bool = False  # temperature > 0: every request has a seed (its own stream); RL rollouts send none

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


CASES: dict[str, dict[str, Case]] = {
    "cpu": {"b8": Case(8, 1, 32, 64), "group2x4": Case(2, 4, 256, 16)},
    "cuda": {
        "b32": Case(32, 1, 128, 128),
        "b128": Case(128, 1, 128, 128),
        "b128_t1": Case(128, 1, 128, 128, temperature=1.0),
        "group8x8": Case(8, 8, 1024, 64),
        "b256": Case(256, 1, 128, 512),
        "group8x8_t1": Case(8, 8, 1024, 64, temperature=1.0),
        "group8x8_t1_seeded": Case(8, 8, 1024, 64, temperature=1.0, seeded=True),
    },
}

# tok/s of SGLang 0.5.17 (CUDA graphs on) in issue 21's H200 run, kept as a labelled extra column
# next to the SGLang numbers measured in the same run (`bench/engine.py --sglang`)
SGLANG_ISSUE21: dict[tuple[str, str], float] = {
    ("dense", "b32"): 17300.0,
    ("dense", "b128"): 53600.0,
    ("dense", "group8x8"): 15400.0,
    ("moe", "b32"): 22100.0,
    ("moe", "b128"): 60400.0,
}


def prompts_for(case: Case, vocab: int) -> torch.Tensor:
    """[batch, prompt] token ids; the samples of one prompt are consecutive rows, as a rollout
    sends a group's n requests."""
    g = torch.Generator().manual_seed(0)
    distinct = torch.randint(0, vocab, (case.prompts, case.prompt), generator=g)
    return distinct.repeat_interleave(case.samples, dim=0)


def sampling_for(case: Case) -> list[SamplingParams]:
    """One SamplingParams per request: exactly `new` tokens (no stop ids), the case's temperature,
    a seed per request only when the case is seeded."""
    return [SamplingParams(temperature=case.temperature, max_new_tokens=case.new,
                           seed=i if case.seeded else None) for i in range(case.batch)]


def requests_for(ids: Sequence[list[int]], sps: Sequence[SamplingParams]) -> list[GenerateRequest]:
    """The requests of one timed run: fresh request ids each run, as a rollout sends them."""
    return [GenerateRequest(input_ids=p, sampling=sp) for p, sp in zip(ids, sps, strict=True)]


def check_results(case: Case, results: Sequence[GenerateResult], engine: str) -> None:
    """A run counts only if every request generated all `new` tokens (tok/s = batch x new / time)."""
    if len(results) != case.batch:
        raise RuntimeError(f"{engine}: {len(results)} results for {case.batch} requests")
    short = [r for r in results if len(r.output_ids) != case.new or r.finish_reason != "length"]
    if short:
        r = short[0]
        raise RuntimeError(f"{engine}: {len(short)} of {case.batch} requests did not generate {case.new} tokens, "
                           f"e.g. {len(r.output_ids)} tokens, finish_reason {r.finish_reason!r}")
