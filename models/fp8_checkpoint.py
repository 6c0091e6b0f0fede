"""Convert an HF checkpoint into a blockwise FP8 one (DeepSeek-V3 layout), for `model.fp8`."""

from __future__ import annotations

from pathlib import Path

from miles.models.fp8_layout import with_fp8
from miles.models.hf_io import load_model, save_model


def convert_to_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                   max_shard_bytes: int | None = None) -> None:
    """Write `src`'s weights to `dst` as FP8 E4M3 codes + `weight_scale_inv` block scales for the
    quantized linear layers (models/fp8_layout.py), with a matching quantization_config."""
    model = load_model(src)
    model.spec = with_fp8(model.spec, block)
    save_model(model, dst, max_shard_bytes)
