"""Checkpoint IO: save -> load round trip, clear errors for bad checkpoints and configs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec
from miles.models.errors import CheckpointError
from miles.models.hf_io import checksums, hf_state_dict, load_model, save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_save_load_round_trip_bit_exact(arch: str, tmp_path) -> None:
    model = build_model(ModelSpec.from_hf(tiny_config(arch, vocab_size=32)), seed=5)
    save_model(model, tmp_path)
    back = load_model(tmp_path)
    assert checksums(back) == checksums(model)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [model.spec.architecture]
    bf = load_model(tmp_path, dtype=torch.bfloat16)
    assert next(bf.parameters()).dtype == torch.bfloat16


def test_bad_checkpoints_name_the_tensor(tmp_path) -> None:
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=32)), seed=0)
    save_model(model, tmp_path)
    path = tmp_path / "model.safetensors"
    full = load_file(str(path))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    save_file({k: v for k, v in full.items() if k != name}, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*experts\.3\.up_proj"):
        load_model(tmp_path)
    save_file({**full, "model.extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.extra.weight'"):
        load_model(tmp_path)
    save_file({**full, name: torch.zeros(3, 3)}, str(path))
    with pytest.raises(CheckpointError, match=r"experts.3.up_proj.weight' has shape \(3, 3\)"):
        load_model(tmp_path)
    assert set(hf_state_dict(model)) == set(full)


def test_unknown_architecture_and_bad_config() -> None:
    with pytest.raises(ConfigError, match="unknown model architecture 'GPT2LMHeadModel'"):
        ModelSpec.from_hf({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="missing required key 'hidden_size'"):
        ModelSpec.from_hf({k: v for k, v in tiny_config("qwen3").items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="rope_type='longrope'"):
        ModelSpec.from_hf(tiny_config("llama", rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(ConfigError, match="unknown tiny preset"):
        tiny_config("gpt2")


def test_model_from_config_preset_is_seeded_and_checkpoint_loads(tmp_path) -> None:
    from miles.core.schema.model import ModelConfig
    from miles.models.factory import model_from_config

    cfg = ModelConfig(arch="qwen3", seed=7, overrides={"num_hidden_layers": 1})
    a, b = model_from_config(cfg, vocab_size=40), model_from_config(cfg, vocab_size=40)
    assert a.spec.num_layers == 1 and checksums(a) == checksums(b)
    save_model(a, tmp_path)
    c = model_from_config(ModelConfig(path=str(tmp_path)), dtype="bfloat16")
    assert next(c.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="vocab_size is 0"):
        model_from_config(ModelConfig())
