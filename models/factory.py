"""Build the policy model from the `[model]` config section: an HF checkpoint or a tiny preset."""

from __future__ import annotations

import torch

from miles.core.errors import ConfigError
from miles.core.schema.model import ModelConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
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
    dtype: str | None = None,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The model named by `cfg` (checkpoint at cfg.path, else preset cfg.arch seeded by cfg.seed).

    `vocab_size` (e.g. the tokenizer's) is used for a preset when cfg.vocab_size is 0;
    `dtype` overrides cfg.dtype (an engine may run in another dtype than the trainer).
    """
    dt = torch_dtype(dtype or cfg.dtype)
    if cfg.path:
        return load_model(cfg.path, dtype=dt, device=device)
    vocab = cfg.vocab_size or vocab_size
    if not vocab:
        raise ConfigError("model.vocab_size is 0 and no tokenizer vocab size was given for the preset")
    spec = ModelSpec.from_hf(tiny_config(cfg.arch, vocab_size=vocab, **cfg.overrides))
    return build_model(spec, dtype=dt, device=device, seed=cfg.seed)
