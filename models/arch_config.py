"""HF config parsing for the parts beyond Llama/Qwen: sliding windows, DeepSeek-style MoE
routing (GLM-4.5 / DeepSeek-V3 / Kimi K2), multi-head latent attention (MLA), gpt-oss and
Qwen3-Next's hybrid layers.

`ModelSpec.from_hf` calls these; each returns keyword fields for `ModelSpec` and raises
ConfigError naming the offending config key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError

Getter = Callable[..., Any]


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from a `kv_lora_rank` latent
    plus one shared `qk_rope_head_dim` rotary key; queries optionally through a `q_lora_rank`
    bottleneck (0 = a plain q_proj)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeltaNetDims:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def history_dim(self) -> int:
        """Per-token values the engine caches for one DeltaNet layer: conv inputs, b, a."""
        return self.conv_dim + 2 * self.num_v_heads


def sliding_fields(cfg: dict[str, Any], model_type: str, n_layers: int, get: Getter) -> dict[str, Any]:
    """Qwen2/Qwen3 `use_sliding_window`: layers >= max_window_layers (or those `layer_types`
    names 'sliding_attention') see only the last `sliding_window` keys; Qwen3-MoE: all layers.
    gpt-oss: always, every even layer unless `layer_types` says otherwise."""
    if model_type == "gpt_oss":
        types = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ]
        cfg = {**cfg, "use_sliding_window": True, "layer_types": types}
    if not cfg.get("use_sliding_window"):
        return {}
    if model_type not in ("qwen2", "qwen3", "qwen3_moe", "gpt_oss"):
        raise ConfigError(f"model config ({model_type}): use_sliding_window=true is not supported for {model_type}")
    window = get("sliding_window")
    if window < 1:
        raise ConfigError(f"model config ({model_type}): sliding_window={window} must be >= 1")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {
            "full_attention", "sliding_attention"
        }:
            raise ConfigError(
                f"model config ({model_type}): layer_types must list 'full_attention'/'sliding_attention' "
                f"for each of the {n_layers} layers, got {types!r}"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif model_type == "qwen3_moe":
        layers = tuple(range(n_layers))
    else:
        first = get("max_window_layers", 28)
        layers = tuple(range(first, n_layers))
    return {"sliding_window": window, "sliding_layers": layers}


def deepseek_moe_fields(cfg: dict[str, Any], model_type: str, n_layers: int, get: Getter) -> dict[str, Any]:
    """Sigmoid router with e_score_correction_bias and group-limited top-k, shared experts,
    dense first `first_k_dense_replace` layers (glm4_moe, deepseek_v3)."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in cfg and cfg[key] != want:
            raise ConfigError(f"model config ({model_type}): {key}={cfg[key]!r} is not supported (only {want!r})")
    n_exp = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    if not isinstance(n_exp, int) or n_exp < 1:
        raise ConfigError(f"model config ({model_type}): n_routed_experts={n_exp!r} must be an int >= 1")
    top_k = get("num_experts_per_tok", 8)
    n_group, topk_group = get("n_group", 1), get("topk_group", 1)
    if n_group < 1 or n_exp % n_group:
        raise ConfigError(f"model config ({model_type}): n_group={n_group} must divide n_routed_experts={n_exp}")
    if n_exp // n_group < 2 and n_group > 1:
        raise ConfigError(f"model config ({model_type}): n_group={n_group} leaves < 2 experts per group")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"model config ({model_type}): topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= n_exp // n_group * topk_group:
        raise ConfigError(
            f"model config ({model_type}): num_experts_per_tok={top_k} must be in [1, experts in the "
            f"topk_group={topk_group} chosen groups = {n_exp // n_group * topk_group}]"
        )
    first_dense = get("first_k_dense_replace", 1)
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"model config ({model_type}): moe_layer_freq={cfg['moe_layer_freq']!r} is not supported (only 1)")
    moe_inter = get("moe_intermediate_size")
    return dict(
        num_experts=n_exp,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=tuple(range(max(first_dense, 0), n_layers)),
        router="sigmoid_group",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=get("routed_scaling_factor", 1.0, float),
        shared_expert_intermediate_size=moe_inter * get("n_shared_experts", 1),
    )


def mla_fields(cfg: dict[str, Any], get: Getter) -> dict[str, Any]:
    """DeepSeek-V3 attention: `head_dim` becomes the q/k head size (nope + rope); the
    config's own `head_dim` (= qk_rope_head_dim in transformers) is not used."""
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora < 1):
        raise ConfigError(f"model config (deepseek_v3): q_lora_rank={q_lora!r} must be null or an int >= 1")
    mla = MLASpec(
        q_lora_rank=q_lora or 0,
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"model config (deepseek_v3): qk_rope_head_dim={mla.qk_rope_head_dim} must be even")
    return {"mla": mla, "head_dim": mla.qk_head_dim}


def gpt_oss_fields(cfg: dict[str, Any], n_layers: int, get: Getter) -> dict[str, Any]:
    """Every layer MoE: num_local_experts experts of intermediate_size, top-k then softmax."""
    quant = cfg.get("quantization_config") or {}
    if quant:
        raise ConfigError(
            f"model config (gpt_oss): quantization_config.quant_method={quant.get('quant_method')!r}: "
            "quantized (MXFP4) expert weights are not supported; dequantize the checkpoint to bf16 first"
        )
    n_exp = get("num_local_experts")
    top_k = get("num_experts_per_tok", 4)
    if not 1 <= top_k <= n_exp:
        raise ConfigError(f"model config (gpt_oss): num_experts_per_tok={top_k} must be in [1, num_local_experts={n_exp}]")
    return dict(
        num_experts=n_exp,
        num_experts_per_tok=top_k,
        moe_intermediate_size=get("intermediate_size"),
        moe_layers=tuple(range(n_layers)),
        router="topk_softmax",
    )


def qwen3_next_fields(cfg: dict[str, Any], n_layers: int, get: Getter) -> dict[str, Any]:
    """Gated DeltaNet layers where `layer_types` says 'linear_attention' (default: all but
    every `full_attention_interval`-th), their dims, and the sigmoid-gated shared expert."""
    types = cfg.get("layer_types")
    if types is None:
        every = get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {
        "full_attention", "linear_attention"
    }:
        raise ConfigError(
            f"model config (qwen3_next): layer_types must list 'full_attention'/'linear_attention' "
            f"for each of the {n_layers} layers, got {types!r}"
        )
    dims = DeltaNetDims(
        num_k_heads=get("linear_num_key_heads"),
        num_v_heads=get("linear_num_value_heads"),
        k_head_dim=get("linear_key_head_dim"),
        v_head_dim=get("linear_value_head_dim"),
        conv_kernel=get("linear_conv_kernel_dim", 4),
    )
    if dims.num_v_heads % dims.num_k_heads:
        raise ConfigError(
            f"model config (qwen3_next): linear_num_value_heads={dims.num_v_heads} is not a multiple "
            f"of linear_num_key_heads={dims.num_k_heads}"
        )
    return dict(
        deltanet=dims,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0),
    )
