"""`ModelSpec`: the architecture of a decoder LM, parsed and validated from an HF config.json dict.

Accepts both the transformers 4 layout (`rope_theta`, `num_experts`) and the
transformers 5 layout (`rope_parameters`, `num_local_experts`). The original dict is
kept in `ModelSpec.hf_config` so saving writes back exactly what was loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.models.arch_config import (
    DeltaNetDims,
    MLASpec,
    deepseek_moe_fields,
    gpt_oss_fields,
    mla_fields,
    qwen3_next_fields,
    sliding_fields,
)
from miles.models.rope import RopeSpec
from miles.models.vl_config import VL_TYPES, VisionSpec, text_view, vl_fields

# HF architecture class name -> model_type; the families miles implements.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    # miles-defined: Qwen2.5-VL's tower and M-RoPE over a Qwen3-MoE-style language side (models/vl_config.py)
    "Qwen2_5_VLMoeForConditionalGeneration": "qwen2_5_vl_moe",
}
MODEL_TYPES: dict[str, str] = {v: k for k, v in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the model code needs about one architecture; build with `from_hf`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    rope: RopeSpec | None = None  # None: default rope over head_dim with rope_theta
    sliding_window: int = 0  # keys a query of a sliding layer sees (itself included); 0 = none
    sliding_layers: tuple[int, ...] = ()
    router: str = "softmax"  # "softmax" (Qwen3-MoE) | "sigmoid_group" (GLM-4.5, DeepSeek-V3) | "topk_softmax" (gpt-oss)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0 = no shared experts
    mla: MLASpec | None = None
    deltanet: DeltaNetDims | None = None  # qwen3_next: dims of its Gated DeltaNet layers
    linear_layers: tuple[int, ...] = ()  # qwen3_next: the Gated DeltaNet layers
    vision: VisionSpec | None = None  # qwen2_5_vl(_moe): the vision tower and M-RoPE (models/vl_config.py)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def architecture(self) -> str:
        return MODEL_TYPES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def rope_spec(self) -> RopeSpec:
        return self.rope or RopeSpec("default", self.rope_theta, self.head_dim)

    @property
    def attn_groups(self) -> int:
        """Query heads per cached K/V head in the attention mask layout (MLA: 1, every head its own)."""
        return 1 if self.mla else self.num_heads // self.num_kv_heads

    def kv_cache_dims_at(self, layer: int) -> tuple[int, int, int]:
        """`kv_cache_dims` of one layer; a Gated DeltaNet layer caches its per-token inputs."""
        if self.deltanet is not None and layer in self.linear_layers:
            return 1, self.deltanet.history_dim, 0
        return self.kv_cache_dims

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, k dim, v dim) of one token's cache entry per layer; MLA caches its
        compressed latent (kv_lora_rank) as "k" and the shared rotary key as "v"."""
        if self.mla:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelSpec:
        """Parse an HF config dict; raise ConfigError naming the offending key."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"model config must be a dict (config.json), got {type(cfg).__name__}")
        model_type = _model_type(cfg)
        nested = cfg
        if model_type in VL_TYPES:  # the language side is parsed from the flat text view
            cfg = text_view(cfg)

        def get(key: str, default: Any = ..., kind: type | tuple[type, ...] = int) -> Any:
            if key not in cfg or cfg[key] is None:
                if default is ...:
                    raise ConfigError(f"model config ({model_type}): missing required key {key!r}")
                return default
            v = cfg[key]
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise ConfigError(f"model config ({model_type}): {key!r}={v!r} is not {kind}")
            return v

        hidden = get("hidden_size")
        heads = get("num_attention_heads")
        kv_heads = get("num_key_value_heads", heads)
        default_hd = 128 if model_type == "qwen3" and "head_dim" not in cfg else hidden // heads
        head_dim = get("head_dim", default_hd)
        if heads % kv_heads:
            raise ConfigError(
                f"model config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if head_dim % 2:
            raise ConfigError(f"model config: head_dim={head_dim} must be even for rotary embeddings")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"model config: hidden_act={act!r} is not supported (only 'silu')")
        n_layers = get("num_hidden_layers")
        extra: dict[str, Any] = sliding_fields(cfg, model_type, n_layers, get)
        if model_type == "deepseek_v3":
            extra.update(mla_fields(cfg, get))
            head_dim = extra.pop("head_dim")
        if model_type in ("glm4_moe", "deepseek_v3"):
            extra.update(deepseek_moe_fields(cfg, model_type, n_layers, get))
        if model_type == "gpt_oss":
            extra.update(gpt_oss_fields(cfg, n_layers, get))
        if model_type == "qwen3_next":
            extra.update(qwen3_next_fields(cfg, n_layers, get))
        if model_type in VL_TYPES:
            extra.update(vl_fields(nested, cfg, head_dim))
        rope_dim = extra["mla"].qk_rope_head_dim if "mla" in extra else head_dim
        rope = RopeSpec.from_hf(cfg, model_type, rope_dim)
        rope_theta = rope.theta
        attn_bias = bool(cfg.get("attention_bias", False))
        spec: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get("rms_norm_eps", 1e-6, float),
            rope_theta=rope_theta,
            max_position_embeddings=get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type in ("qwen2", *VL_TYPES) else attn_bias,
            o_bias=False if model_type in ("qwen2", "glm4_moe", *VL_TYPES) else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm", False)),
            rope=None if rope.rope_type == "default" and rope.dim == head_dim else rope,
            **extra,
        )
        if model_type in ("qwen3_moe", "qwen3_next", "qwen2_5_vl_moe"):
            n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
            if not isinstance(n_exp, int) or n_exp < 0:
                raise ConfigError(f"model config (qwen3_moe): num_experts={n_exp!r} must be an int >= 0")
            top_k = get("num_experts_per_tok", 8)
            step = get("decoder_sparse_step", 1)
            only = cfg.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
                raise ConfigError(f"model config: mlp_only_layers={only!r} must be a list of ints")
            if step < 1:
                raise ConfigError(f"model config: decoder_sparse_step={step} must be >= 1")
            moe_layers = tuple(
                i for i in range(n_layers) if i not in only and n_exp > 0 and (i + 1) % step == 0
            )
            if moe_layers and not 1 <= top_k <= n_exp:
                raise ConfigError(
                    f"model config: num_experts_per_tok={top_k} must be in [1, num_experts={n_exp}]"
                )
            spec.update(
                num_experts=n_exp,
                num_experts_per_tok=top_k,
                moe_intermediate_size=get("moe_intermediate_size"),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=moe_layers,
            )
        out = dict(nested)
        out.setdefault("architectures", [MODEL_TYPES[model_type]])
        out.setdefault("model_type", model_type)
        return cls(**spec, hf_config=out)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"model directory {str(path)!r} has no config.json")
        try:
            return cls.from_hf(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p} is not valid JSON: {exc}") from exc


def _model_type(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        name = archs[0]
        if name not in ARCHITECTURES:
            raise ConfigError(
                f"unknown model architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        return ARCHITECTURES[name]
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(
            f"unknown model_type {mt!r} (and no 'architectures'); supported: {', '.join(sorted(MODEL_TYPES))}"
        )
    return str(mt)

