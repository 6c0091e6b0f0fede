"""Rope scaling (linear, dynamic, yarn, llama3), partial rotary and sliding windows: logits equal
to transformers (fp32, tiny random configs), and what is not supported is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.hf_io import load_model, save_model
from miles.models.invariant import BatchInvariant
from miles.models.masks import cached_causal_mask
from miles.models.presets import tiny_config
from miles.models.registry import build_model

from .test_models_numerics import hf_model

MAX_POS = 16  # short, so the 24-token inputs below run past it (dynamic rescales, yarn/llama3 matter)
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                    "mscale": 0.8, "mscale_all_dim": 0.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
}


def _compare(cfg: dict, tmp_path, t: int = 24) -> torch.Tensor:
    ref = hf_model(cfg, 0)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    ids = torch.randint(0, cfg["vocab_size"], (2, t), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    return ids


@pytest.mark.parametrize(
    ("arch", "name"), [("llama", n) for n in sorted(ROPES)] + [("qwen2", "yarn"), ("qwen2", "dynamic")]
)
def test_rope_scaling_matches_transformers(arch: str, name: str, tmp_path) -> None:
    rope = dict(ROPES[name], rope_theta=10000.0)
    cfg = tiny_config(arch, initializer_range=0.2, max_position_embeddings=MAX_POS, rope_parameters=rope)
    _compare(cfg, tmp_path)
    spec = ModelSpec.from_dir(tmp_path / "hf")
    assert spec.rope_spec.rope_type == rope["rope_type"]
    # both sides of a round trip keep the scaling: what miles saves, transformers reads back the same
    save_model(load_model(tmp_path / "hf"), tmp_path / "miles")
    assert ModelSpec.from_dir(tmp_path / "miles").rope_spec == spec.rope_spec


def test_transformers4_rope_scaling_key_is_read() -> None:
    cfg = tiny_config("llama", rope_scaling={"type": "linear", "factor": 2.0})
    spec = ModelSpec.from_hf(cfg)
    assert spec.rope_spec.rope_type == "linear" and spec.rope_spec.factor == 2.0


def test_dynamic_rope_past_max_positions_changes_logits_and_refuses_invariant() -> None:
    spec = ModelSpec.from_hf(tiny_config("llama", max_position_embeddings=8,
                                         rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    plain = ModelSpec.from_hf(tiny_config("llama", max_position_embeddings=8))
    a, b = build_model(spec, seed=0), build_model(plain, seed=0)
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
        assert torch.equal(a(ids[:, :8]).logits, b(ids[:, :8]).logits)  # within max: default rope
    assert not torch.allclose(la, lb)
    with BatchInvariant(), pytest.raises(ModelInputError, match="dynamic"):
        a(ids)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_parameters.rope_type='longrope'"),
        ("rope_scaling", {"type": "su"}, "rope_scaling.rope_type='su'"),
        ("rope_parameters", {"rope_type": "linear"}, "rope_parameters.factor=None"),
        ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ("partial_rotary_factor", 1.5, "partial_rotary_factor"),
    ],
)
def test_unsupported_rope_is_refused_naming_the_key(key: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match.replace("[", r"\[").replace(".", r"\.")):
        ModelSpec.from_hf(tiny_config("llama", **{key: value}))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sliding_window_matches_transformers(arch: str, tmp_path) -> None:
    cfg = tiny_config(arch, initializer_range=0.2, use_sliding_window=True, sliding_window=5,
                      max_window_layers=1, num_hidden_layers=3)
    _compare(cfg, tmp_path, t=14)
    spec = ModelSpec.from_dir(tmp_path / "hf")
    assert spec.sliding_window == 5 and spec.sliding_layers == (1, 2)


def test_sliding_window_decode_over_a_cache_equals_full_forward() -> None:
    """The engine's layout (keys at slot = position, T=1 steps without a mask, prefill with a
    cached mask) gives the logits of one full forward."""
    spec = ModelSpec.from_hf(tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0))
    model = build_model(spec, seed=0)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        cache = _ListCache()
        pre = 5
        model(ids[:, :pre], attention_mask=cached_causal_mask(torch.zeros(2, dtype=torch.long), pre, pre),
              kv_cache=cache)
        for i in range(pre, 12):
            pos = torch.full((2, 1), i)
            step = model(ids[:, i : i + 1], pos, kv_cache=cache).logits
            assert (step[:, 0] - full[:, i]).abs().max().item() <= 1e-5


class _ListCache:
    """The minimal `KVCache`: concatenates each layer's keys/values (slot = position)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.kv:
            k, v = torch.cat((self.kv[layer][0], k), 2), torch.cat((self.kv[layer][1], v), 2)
        self.kv[layer] = (k, v)
        return k, v


def test_sliding_window_refused_where_no_transformers_semantics() -> None:
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelSpec.from_hf(tiny_config("llama", use_sliding_window=True, sliding_window=4))
    with pytest.raises(ConfigError, match="sliding_window=0"):
        ModelSpec.from_hf(tiny_config("qwen2", use_sliding_window=True, sliding_window=0))
