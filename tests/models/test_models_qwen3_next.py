"""Qwen3-Next (Gated DeltaNet + gated attention hybrid, sigmoid-gated shared expert): logits and
round trips vs transformers, packed sequences, the torch engine (DeltaNet history in the KV
cache) with R3 recording and FSDP2 replay, and true on-policy."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles.models.config import ModelSpec
from miles.models.hf_io import load_model, save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

from ..recipes.test_recipes_true_on_policy import _max_diff
from .test_models_deepseek_v3_glm4_moe import engine_r3_round_trip
from .test_models_numerics import hf_model

VARIANTS = [
    {},
    {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
     "linear_num_key_heads": 4, "num_key_value_heads": 4, "mlp_only_layers": [0]},
]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_logits_match_transformers_both_ways(variant: int, tmp_path) -> None:
    cfg = tiny_config("qwen3_next", initializer_range=0.1, **VARIANTS[variant])
    ref = hf_model(cfg, variant)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.spec.linear_layers == tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "linear_attention")
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(variant))
    with torch.no_grad():
        got = ours(ids).logits
        assert (got - ref(input_ids=ids).logits).abs().max().item() <= 1e-5
    save_model(ours, tmp_path / "miles")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "miles", attn_implementation="eager")
    with torch.no_grad():
        assert (back(input_ids=ids).logits - got).abs().max().item() <= 1e-5


def test_packed_sequences_restart_the_recurrence_and_convolution() -> None:
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3_next")), seed=0)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 7), generator=g), torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        packed = model(torch.cat((a, b), 1), cu_seqlens=torch.tensor([0, 7, 12])).logits
        alone = torch.cat((model(a).logits, model(b).logits), 1)
    assert (packed - alone).abs().max().item() <= 1e-5


async def test_engine_records_routes_and_fsdp_replay_reproduces_logprobs() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3_next", vocab_size=97, initializer_range=0.15,
                                         num_experts_per_tok=1))
    await engine_r3_round_trip(build_model(spec, seed=5), seed=5)


async def test_true_on_policy_engine_and_trainer_logprobs_are_bitwise_equal() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3_next", vocab_size=64, initializer_range=0.1))
    assert await _max_diff(spec, True, torch.bfloat16) == 0.0
