"""The vision side of a Qwen2.5-VL-style config: `VisionSpec`, and `vl_fields` that parses it.

A Qwen2.5-VL `config.json` nests the language model under `text_config` (transformers 5) or
keeps it at the top level (transformers 4 / the original checkpoints), with the vision tower
under `vision_config`. `text_view` gives the flat dict `ModelSpec.from_hf` parses for the
language side; `vl_fields` gives the vision fields. `qwen2_5_vl_moe` is a miles-defined
variant: the same tower and M-RoPE over a Qwen3-MoE-style language side (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`,
`mlp_only_layers` in its text config); transformers has no class for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError

VL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_moe")


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower: patch embedding, `depth` blocks (window attention except at
    `fullatt_blocks`), and the patch merger to the LM's hidden size."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # pixels per window side (window attention spans window_size // merge // patch units)
    out_hidden_size: int
    fullatt_blocks: tuple[int, ...]
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]  # rotary channel pairs driven by the (t, h, w) positions, in turn

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one LM token."""
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Merged units per window side."""
        return max(self.window_size // self.spatial_merge_size // self.patch_size, 1)


def text_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The flat language-model dict of a VL config: `text_config` over the top level, with
    the top-level `architectures` and `tie_word_embeddings` (transformers ties at the top)."""
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"model config: text_config={text!r} must be a dict")
    flat = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    flat.update(text)
    for key in ("architectures", "model_type"):
        if key in cfg:
            flat[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        flat["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    # the transformers 4 layout names the rope type "mrope": plain rope frequencies, M-RoPE positions
    for key in ("rope_parameters", "rope_scaling"):
        params = flat.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "mrope":
            flat[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "default"}
    return flat


def _mrope_section(flat: dict[str, Any], head_dim: int) -> tuple[int, ...]:
    params = flat.get("rope_parameters") or flat.get("rope_scaling") or {}
    section = params.get("mrope_section") if isinstance(params, dict) else None
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(s, int) and s >= 0 for s in section)):
        raise ConfigError(f"model config (qwen2_5_vl): rope_parameters.mrope_section={section!r} must be "
                          "3 non-negative ints (channel pairs for the t, h, w positions)")
    if sum(section) != head_dim // 2:
        raise ConfigError(f"model config (qwen2_5_vl): rope_parameters.mrope_section={section} sums to "
                          f"{sum(section)}, but head_dim={head_dim} has {head_dim // 2} rotary pairs")
    return tuple(section)


def vl_fields(cfg: dict[str, Any], flat: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`ModelSpec` fields of the vision side; ConfigError naming the key on bad input."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ConfigError("model config (qwen2_5_vl): missing vision_config (a dict)")

    def num(key: str, default: Any = ..., where: dict[str, Any] = v, name: str = "vision_config") -> int:
        val = where.get(key, default)
        if val is ...:
            raise ConfigError(f"model config (qwen2_5_vl): missing required key {name}.{key}")
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ConfigError(f"model config (qwen2_5_vl): {name}.{key}={val!r} must be an int >= 0")
        return val

    act = v.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"model config (qwen2_5_vl): vision_config.hidden_act={act!r} is not supported (only 'silu')")
    depth = num("depth", v.get("num_hidden_layers", ...))
    hidden, heads = num("hidden_size"), num("num_heads", v.get("num_attention_heads", ...))
    if heads < 1 or hidden % heads or (hidden // heads) % 4:
        raise ConfigError(f"model config (qwen2_5_vl): vision_config hidden_size={hidden} / num_heads={heads} "
                          "must give a head dim divisible by 4 (2-D rotary over h and w)")
    full = v.get("fullatt_block_indexes", [])
    if not isinstance(full, list | tuple) or not all(isinstance(i, int) and 0 <= i < depth for i in full):
        raise ConfigError(f"model config (qwen2_5_vl): vision_config.fullatt_block_indexes={full!r} "
                          f"must list block indices in [0, {depth})")
    rope = v.get("rope_parameters") or {}
    theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
    top = {**flat, **cfg}
    vision = VisionSpec(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=num("intermediate_size"),
        num_heads=heads,
        in_channels=num("in_channels", 3),
        patch_size=num("patch_size", 14),
        temporal_patch_size=num("temporal_patch_size", 2),
        spatial_merge_size=num("spatial_merge_size", 2),
        window_size=num("window_size", 112),
        out_hidden_size=num("out_hidden_size", flat.get("hidden_size")),
        fullatt_blocks=tuple(full),
        rope_theta=float(theta),
        image_token_id=num("image_token_id", ..., top, "config"),
        vision_start_token_id=num("vision_start_token_id", 0, top, "config") if "vision_start_token_id" in top else -1,
        vision_end_token_id=num("vision_end_token_id", 0, top, "config") if "vision_end_token_id" in top else -1,
        mrope_section=_mrope_section(flat, head_dim),
    )
    if vision.out_hidden_size != flat.get("hidden_size"):
        raise ConfigError(f"model config (qwen2_5_vl): vision_config.out_hidden_size={vision.out_hidden_size} "
                          f"must equal the language hidden_size={flat.get('hidden_size')}")
    if min(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size, vision.in_channels) < 1:
        raise ConfigError("model config (qwen2_5_vl): vision_config patch_size, temporal_patch_size, "
                          "spatial_merge_size and in_channels must be >= 1")
    return {"vision": vision}
