"""Config section for the policy model: checkpoint or tiny preset, dtype, random-init seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt
from miles.core.errors import ConfigError

PRESETS = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next",
           "qwen2_5_vl", "qwen2_5_vl_moe")


@dataclass
class ModelConfig:
    path: str = opt("", "HF checkpoint directory (config.json + safetensors); '' = use `arch` preset", "path")
    arch: str = opt(
        "qwen3_moe",
        "tiny preset used when path is '': llama | qwen2 | qwen3 | qwen3_moe | glm4_moe | deepseek_v3 | gpt_oss "
        "| qwen3_next | qwen2_5_vl | qwen2_5_vl_moe (vision-language, docs/models.md) (random weights)",
    )
    vocab_size: int = opt(0, "vocab size of the tiny preset; 0 = the tokenizer's size")
    overrides: dict[str, int | float | bool | str] = opt({}, "extra HF config keys for the tiny preset")
    seed: int = opt(0, "seed of the random init of a tiny preset")
    fp8: Literal["off", "blockwise"] = opt(
        "off",
        "low-precision contract (docs/fp8.md): blockwise = engine and trainer compute every attention/MLP "
        "linear layer with the same FP8 E4M3 weights, one fp32 scale per fp8_block x fp8_block block "
        "(real FP8 GEMMs on Hopper); a checkpoint must then carry a matching FP8 quantization_config",
    )
    fp8_block: int = opt(128, "rows and columns of one FP8 weight block (one scale each)", "elements")

    def __post_init__(self) -> None:
        if not self.path and self.arch not in PRESETS:
            raise ConfigError(f"model.arch={self.arch!r}: expected one of {', '.join(PRESETS)}")
        if self.fp8_block < 1:
            raise ConfigError(f"model.fp8_block={self.fp8_block} must be >= 1")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size={self.vocab_size} must be >= 0")
