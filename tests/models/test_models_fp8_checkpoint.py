"""Blockwise FP8 checkpoints (DeepSeek-V3 layout: `X.weight` F8_E4M3 + `X.weight_scale_inv` F32,
`quantization_config.weight_block_size`): written, loaded, checked against `model.fp8`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.core.errors import ConfigError
from miles.core.schema.engine import EngineConfig
from miles.core.schema.model import ModelConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.errors import CheckpointError
from miles.models.factory import model_from_config
from miles.models.fp8 import FP8, dequantize_blockwise, quantize_blockwise
from miles.models.fp8_checkpoint import convert_to_fp8
from miles.models.fp8_layout import fp8_block, with_fp8
from miles.models.fp8_model import fp8_hf_names
from miles.models.hf_io import hf_tensor_views, iter_checkpoint, load_model, save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

BLOCK = (32, 32)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama"])
def test_fp8_checkpoint_roundtrip_and_engine_trainer_agree(tmp_path: Path, arch: str) -> None:
    spec = with_fp8(ModelSpec.from_hf(tiny_config(arch, vocab_size=64, num_hidden_layers=2)), BLOCK)
    save_model(build_model(spec, seed=3), tmp_path, max_shard_bytes=20_000)  # codes and scales in other shards
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [32, 32]}
    files = _tensors(tmp_path)
    names = fp8_hf_names(spec)
    assert names and all(files[n].dtype == FP8 and files[n + "_scale_inv"].dtype == torch.float32 for n in names)
    assert files["model.embed_tokens.weight"].dtype == torch.float32
    # trainer: float masters = the dequantized codes, bit for bit
    trainer = load_model(tmp_path)
    views = hf_tensor_views(trainer)
    for n in names:
        assert torch.equal(views[n], dequantize_blockwise(files[n], files[n + "_scale_inv"], BLOCK))
    # engine: from the config switch; it computes with the trainer's weights exactly
    mcfg = ModelConfig(path=str(tmp_path), fp8="blockwise", fp8_block=32)
    engine = TorchEngine.from_config(EngineConfig(), mcfg)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(engine.model(ids).logits, trainer(ids).logits)
    assert fp8_block(engine.spec) == BLOCK
    # re-quantizing the loaded weights reproduces the file's codes and scales bit for bit
    held = engine.state_dict_hf()
    for n in names:
        for k in (n, n + "_scale_inv"):
            assert torch.equal(held[k].view(torch.uint8), files[k].view(torch.uint8)), k


def test_model_fp8_must_match_the_checkpoint(tmp_path: Path) -> None:
    plain = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    save_model(build_model(plain, seed=1), tmp_path / "bf16")
    save_model(build_model(with_fp8(plain, BLOCK), seed=1), tmp_path / "fp8")
    with pytest.raises(ConfigError, match="is an FP8 checkpoint"):
        model_from_config(ModelConfig(path=str(tmp_path / "fp8")))
    with pytest.raises(ConfigError, match="weight_block_size"):
        model_from_config(ModelConfig(path=str(tmp_path / "fp8"), fp8="blockwise", fp8_block=128))
    with pytest.raises(ConfigError, match="no FP8 quantization_config"):
        model_from_config(ModelConfig(path=str(tmp_path / "bf16"), fp8="blockwise", fp8_block=32))
    # converting the plain checkpoint gives the FP8 one
    convert_to_fp8(tmp_path / "bf16", tmp_path / "conv", BLOCK)
    a, b = _tensors(tmp_path / "fp8"), _tensors(tmp_path / "conv")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert fp8_block(model_from_config(ModelConfig(path=str(tmp_path / "conv"), fp8="blockwise",
                                                   fp8_block=32)).spec) == BLOCK


def test_fp8_tensors_outside_the_quantized_set_are_dequantized(tmp_path: Path) -> None:
    """DeepSeek-V3-style checkpoints store routed experts in FP8 too: they load dequantized
    into the compute dtype; a code tensor without its scale is an error naming it."""
    spec = with_fp8(ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=1)), BLOCK)
    save_model(build_model(spec, seed=2), tmp_path)
    files = _tensors(tmp_path)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    codes, scale = quantize_blockwise(files[name], BLOCK)
    files[name], files[name + "_scale_inv"] = codes, scale
    save_file(files, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    m = load_model(tmp_path)
    assert torch.equal(hf_tensor_views(m)[name], dequantize_blockwise(codes, scale, BLOCK))
    del files[name + "_scale_inv"]
    save_file(files, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj.weight"):
        load_model(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice(name).get_dtype() == "F8_E4M3"


def test_load_checks_name_what_conflicts_with_fp8() -> None:
    import dataclasses

    from miles.core.config import load_config
    from miles.core.schema import MilesConfig
    from miles.core.schema.resolve import fp8_errors

    cfg = MilesConfig()
    assert fp8_errors(cfg) == []
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8="blockwise"))
    assert fp8_errors(cfg) == []
    cfg.trainer.lora.rank = 4
    cfg.trainer.backend = "megatron"  # type: ignore[assignment]
    errs = fp8_errors(cfg)
    assert len(errs) == 2 and "trainer.backend" in errs[0] and "LoRA" in errs[1]
    with pytest.raises(ConfigError, match="model.fp8 = 'blockwise' needs engine.type = 'torch'"):
        load_config(MilesConfig, None, ["model.fp8=blockwise", "engine.type=sglang"])
