"""Build the policy model from the `[model]` config section: an HF checkpoint or a tiny preset."""

from __future__ import annotations

import torch

from miles.core.errors import ConfigError
from miles.core.schema.model import ModelConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8_layout import fp8_block, with_fp8
from miles.models.hf_io import load_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def model_from_config(
    cfg: ModelConfig,
    vocab_size: int | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The model named by `cfg` (checkpoint at cfg.path, else preset cfg.arch seeded by cfg.seed).

    `vocab_size` (e.g. the tokenizer's) is used for a preset when cfg.vocab_size is 0;
    `dtype` is the caller's (the engine's or the trainer's): the model section holds none.
    """
    dt = torch_dtype(dtype)
    if cfg.path:
        check_fp8_checkpoint(cfg, ModelSpec.from_dir(cfg.path))
        return load_model(cfg.path, dtype=dt, device=device)
    vocab = cfg.vocab_size or vocab_size
    if not vocab:
        raise ConfigError("model.vocab_size is 0 and no tokenizer vocab size was given for the preset")
    spec = ModelSpec.from_hf(tiny_config(cfg.arch, vocab_size=vocab, **cfg.overrides))
    if cfg.fp8 == "blockwise":
        spec = with_fp8(spec, (cfg.fp8_block, cfg.fp8_block))
    return build_model(spec, dtype=dt, device=device, seed=cfg.seed)


def check_fp8_checkpoint(cfg: ModelConfig, spec: ModelSpec) -> None:
    """model.fp8 must agree with the checkpoint: every role builds its model from the
    checkpoint's config, so the config decides whether the FP8 contract applies."""
    block = fp8_block(spec)
    want = (cfg.fp8_block, cfg.fp8_block) if cfg.fp8 == "blockwise" else None
    if block == want:
        return
    if want is None:
        raise ConfigError(f"model.path {cfg.path!r} is an FP8 checkpoint (weight_block_size {list(block or ())}): "
                          f"set model.fp8 = 'blockwise' and model.fp8_block = {(block or (0,))[0]}")
    if block is None:
        raise ConfigError(f"model.fp8 = 'blockwise' but model.path {cfg.path!r} has no FP8 quantization_config; "
                          "convert it with miles.models.fp8_checkpoint.convert_to_fp8 (docs/fp8.md)")
    raise ConfigError(f"model.fp8_block = {cfg.fp8_block} but checkpoint {cfg.path!r} has weight_block_size "
                      f"{list(block)}; only square blocks equal to model.fp8_block are accepted")
