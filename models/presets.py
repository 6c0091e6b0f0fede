"""Tiny HF config dicts for tests, the quick start and benchmarks (random weights)."""

from __future__ import annotations

from typing import Any

from miles.core.errors import ConfigError
from miles.models.config import ARCHITECTURES, MODEL_TYPES


def tiny_config(arch: str, vocab_size: int = 256, **overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for a tiny model of `arch` ('llama', 'qwen2', 'qwen3', 'qwen3_moe',
    'glm4_moe', 'deepseek_v3', 'gpt_oss', 'qwen3_next' or the HF class name); keyword overrides replace or add keys."""
    model_type = ARCHITECTURES.get(arch, arch)
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unknown tiny preset {arch!r}; valid: {', '.join(sorted(MODEL_TYPES))}")
    cfg: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if model_type == "llama":
        cfg["mlp_bias"] = False
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    if model_type == "qwen3_next":
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            layer_types=["linear_attention", "full_attention"],
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
        )
    if model_type == "qwen3_moe":
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    if model_type in ("glm4_moe", "deepseek_v3"):
        cfg.update(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
        )
    if model_type == "glm4_moe":
        cfg.update(partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)
    if model_type == "deepseek_v3":
        del cfg["head_dim"]
        cfg.update(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=True,
        )
    if model_type == "gpt_oss":
        cfg.update(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            attention_bias=True,
            sliding_window=4,
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0},
        )
    if model_type in ("qwen2_5_vl", "qwen2_5_vl_moe"):
        return _vl(cfg, model_type, vocab_size, overrides)
    cfg.update(overrides)
    return cfg


_VL_TOP = ("vision_config", "image_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")


def _vl(text: dict[str, Any], model_type: str, vocab_size: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """A tiny Qwen2.5-VL-style config: the language side nested as `text_config` (M-RoPE over
    head_dim 16: 2 + 3 + 3 pairs), a 2-block tower (patch 4, 2 frames, merge 2, 16-pixel
    windows, block 1 full attention); image / vision start / end ids are the last three ids."""
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                rms_norm_eps=1e-5)
    if model_type == "qwen2_5_vl_moe":
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[])
    text.update({k: v for k, v in overrides.items() if k not in _VL_TOP})
    top = {k: v for k, v in overrides.items() if k in _VL_TOP}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=16, out_hidden_size=text["hidden_size"],
                  fullatt_block_indexes=[1], in_channels=3, hidden_act="silu")
    vision.update(top.pop("vision_config", {}))
    return {
        "architectures": text["architectures"], "model_type": model_type,
        "image_token_id": vocab_size - 1, "vision_start_token_id": vocab_size - 3,
        "vision_end_token_id": vocab_size - 2, "tie_word_embeddings": bool(text.get("tie_word_embeddings")),
        **top, "text_config": text, "vision_config": vision,
    }
