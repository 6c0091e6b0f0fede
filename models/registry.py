"""Architecture name -> model class (a `Registry`), and `build_model` for a `ModelSpec`."""

from __future__ import annotations

import torch

from miles.core.errors import ConfigError
from miles.core.hooks import Registry
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8_layout import fp8_block
from miles.models.fp8_model import attach_fp8

# Families whose every quantized projection the FP8 contract (models/fp8_linear.py) covers.
FP8_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# One class covers every family: they differ only in what ModelSpec switches on.
MODELS = Registry(
    "model architecture",
    {
        "LlamaForCausalLM": "miles.models.decoder:CausalLM",
        "Qwen2ForCausalLM": "miles.models.decoder:CausalLM",
        "Qwen3ForCausalLM": "miles.models.decoder:CausalLM",
        "Qwen3MoeForCausalLM": "miles.models.decoder:CausalLM",
        "Glm4MoeForCausalLM": "miles.models.decoder:CausalLM",
        "DeepseekV3ForCausalLM": "miles.models.decoder:CausalLM",
        "GptOssForCausalLM": "miles.models.decoder:CausalLM",
        "Qwen3NextForCausalLM": "miles.models.decoder:CausalLM",
    },
)


def build_model(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> CausalLM:
    """Instantiate the model for `spec`; random-init with `seed` when given (else uninitialised)."""
    cls = MODELS.get(spec.architecture)
    model: CausalLM = cls(spec)
    block = fp8_block(spec)
    if block is not None and spec.model_type not in FP8_FAMILIES:
        raise ConfigError(
            f"{spec.model_type} under FP8 (quantization_config / model.fp8): the FP8 contract covers the "
            f"attention and MLP projections of {', '.join(FP8_FAMILIES)} only; {spec.model_type}'s attention "
            "(MLA / sinks / gated / DeltaNet) is not under it. Dequantize the checkpoint to bf16 or set model.fp8='off'"
        )
    if block is not None:  # FP8 contract: the linear layers compute with quantized weights
        attach_fp8(model, block)
    if seed is not None:
        model.init_weights(seed)
    return model.to(device=device, dtype=dtype).eval()
