"""gpt-oss: attention sinks, alternating sliding windows, biased clamped-SwiGLU experts with a
top-k-then-softmax router. Logits and round trips vs transformers, the torch engine with R3
recording and FSDP2 replay, true on-policy, and the MXFP4 refusal."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec
from miles.models.hf_io import load_model, save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

from ..recipes.test_recipes_true_on_policy import _max_diff
from .test_models_deepseek_v3_glm4_moe import engine_r3_round_trip
from .test_models_numerics import hf_model


# initializer 0.1: logits of a few units, so fp32 reordering stays well under 1e-5
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_logits_match_transformers_both_ways(kv_heads: int, tmp_path) -> None:
    cfg = tiny_config("gpt_oss", initializer_range=0.1, num_hidden_layers=3, num_key_value_heads=kv_heads)
    ref = hf_model(cfg, kv_heads)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.spec.sliding_layers == (0, 2) and ours.spec.sliding_window == 4
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(kv_heads))
    with torch.no_grad():
        got = ours(ids).logits
        assert (got - ref(input_ids=ids).logits).abs().max().item() <= 1e-5
    save_model(ours, tmp_path / "miles")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "miles", attn_implementation="eager")
    with torch.no_grad():
        assert (back(input_ids=ids).logits - got).abs().max().item() <= 1e-5


async def test_engine_records_routes_and_fsdp_replay_reproduces_logprobs() -> None:
    # prompts and outputs run past the 4-token window: the engine's sliding layers over its cache
    spec = ModelSpec.from_hf(tiny_config("gpt_oss", vocab_size=97, initializer_range=0.15,
                                         num_hidden_layers=2, num_experts_per_tok=1))
    await engine_r3_round_trip(build_model(spec, seed=4), seed=4)


async def test_true_on_policy_engine_and_trainer_logprobs_are_bitwise_equal() -> None:
    spec = ModelSpec.from_hf(tiny_config("gpt_oss", vocab_size=64, initializer_range=0.1))
    assert await _max_diff(spec, True, torch.bfloat16) == 0.0


def test_mxfp4_checkpoints_are_refused_naming_the_key() -> None:
    cfg = tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="quantization_config.quant_method='mxfp4'"):
        ModelSpec.from_hf(cfg)
