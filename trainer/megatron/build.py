"""Build a megatron-core GPTModel (dense or MoE) from a miles `ModelSpec`.

The model is a fp32 master copy on the current CUDA device; forward/backward run in
bf16 under autocast (like FSDP2's mixed precision: master weights, optimizer state and
gradients stay fp32). Initial weights always come from HF tensors (`weights.load_hf`),
so the same seed or checkpoint gives the FSDP2 backend's exact starting point.

HF semantics mapped onto megatron options:
  RMSNorm + SwiGLU (gated_linear_unit, silu), RoPE (rotate-half, base rope_theta),
  Qwen2 q/k/v bias (add_qkv_bias), Qwen3 per-head q/k RMSNorm (qk_layernorm),
  Qwen3-MoE softmax top-k router: norm_topk_prob=True equals softmax over the k selected
  logits (moe_router_pre_softmax=False), False equals top-k of the full softmax (True).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles.core.errors import ConfigError
from miles.core.schema.trainer import MegatronConfig
from miles.models.config import ModelSpec
from miles.trainer.megatron.available import transformer_engine_installed


def check_parallel(mc: MegatronConfig, spec: ModelSpec, world: int) -> tuple[int, int, int]:
    """(tp, ep, dp) for `world` ranks; ConfigError naming the field when they do not fit."""
    if spec.vision is not None:  # the vision tower and M-RoPE have no megatron mapping
        raise ConfigError(f"the megatron backend does not map {spec.model_type} (vision tower, M-RoPE); "
                          "train it with trainer.backend='fsdp'")
    if spec.model_type in ("glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next"):
        # the layout maps fused GQA q/k/v and a softmax router; MLA, the sigmoid group-limited
        # router with its bias correction, shared experts, attention sinks, biased experts and
        # Gated DeltaNet layers have no mapping here yet
        raise ConfigError(f"the megatron backend does not map {spec.model_type} (MLA / sigmoid router / "
                          "shared experts / attention sinks / biased experts / Gated DeltaNet); "
                          "train it with trainer.backend='fsdp'")
    tp, pp, ep = mc.tensor_parallel_size, mc.pipeline_parallel_size, mc.expert_parallel_size
    for name, v in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
        if v < 1:
            raise ConfigError(f"trainer.megatron.{name}_parallel_size must be >= 1, got {v}")
    if pp != 1:
        raise ConfigError(
            f"trainer.megatron.pipeline_parallel_size={pp}: this backend runs one pipeline stage "
            "(the pipeline schedule is not implemented); use tensor/expert parallelism"
        )
    if world % tp:
        raise ConfigError(f"trainer.megatron.tensor_parallel_size={tp} does not divide {world} ranks")
    dp = world // tp
    if ep > 1 and not spec.is_moe:
        raise ConfigError(f"trainer.megatron.expert_parallel_size={ep} needs a MoE model")
    if dp % ep:
        raise ConfigError(
            f"trainer.megatron.expert_parallel_size={ep} must divide the data-parallel size {dp}"
        )
    if spec.is_moe and spec.num_experts % ep:
        raise ConfigError(f"expert_parallel_size={ep} does not divide num_experts={spec.num_experts}")
    for what, n in (("vocab_size", spec.vocab_size), ("num_key_value_heads", spec.num_kv_heads)):
        if n % tp:
            raise ConfigError(f"trainer.megatron.tensor_parallel_size={tp} does not divide {what}={n}")
    if spec.o_bias != spec.mlp_bias and not spec.is_moe:
        raise ConfigError(
            "megatron ties the o_proj and MLP biases (add_bias_linear): attention_bias and "
            f"mlp_bias must agree, got o_bias={spec.o_bias}, mlp_bias={spec.mlp_bias}"
        )
    if spec.is_moe and spec.o_bias:
        raise ConfigError("megatron MoE experts have no bias: attention_bias must be false")
    if spec.is_moe and tp > 1 and not use_te(mc):
        # megatron trains MoE with TP only under sequence parallelism, which the local
        # spec's torch norms refuse
        raise ConfigError(
            f"trainer.megatron.tensor_parallel_size={tp} with a MoE model needs Transformer "
            "Engine (sequence parallelism); use expert_parallel_size instead"
        )
    if spec.rope_theta != int(spec.rope_theta):
        raise ConfigError(f"megatron takes an integer rotary base; rope_theta={spec.rope_theta}")
    if spec.rope is not None or spec.sliding_layers:
        raise ConfigError("the megatron backend maps only the default full-width rope without sliding "
                          f"windows; got rope_type={spec.rope_spec.rope_type!r}, rotary dim {spec.rope_spec.dim}, "
                          f"sliding_window={spec.sliding_window}; use trainer.backend='fsdp'")
    return tp, ep, dp


def use_te(mc: MegatronConfig) -> bool:
    if mc.transformer_impl == "transformer_engine":
        if not transformer_engine_installed():
            raise ConfigError(
                "trainer.megatron.transformer_impl='transformer_engine' but transformer_engine "
                "is not installed; use 'local' or 'auto'"
            )
        return True
    return False  # 'local' (auto was resolved when the section was built: core/schema/trainer.py)


def init_parallel(mc: MegatronConfig, seed: int) -> None:
    """megatron's parallel_state and CUDA RNG tracker, over the default process group."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=mc.tensor_parallel_size,
            pipeline_model_parallel_size=mc.pipeline_parallel_size,
            expert_model_parallel_size=mc.expert_parallel_size,
            expert_tensor_parallel_size=1,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(spec: ModelSpec, mc: MegatronConfig, te: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = mc.tensor_parallel_size
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=spec.o_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        rotary_interleaved=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=mc.pipeline_parallel_size,
        expert_model_parallel_size=mc.expert_parallel_size,
        expert_tensor_parallel_size=1,
        sequence_parallel=te and tp > 1,  # torch norms (local spec) refuse sequence parallel
        params_dtype=torch.float32,
        bf16=False,
        perform_initialization=False,  # weights come from HF tensors
        use_cpu_initialization=False,
        transformer_impl="transformer_engine" if te else "local",
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.num_experts_per_tok,
            moe_ffn_hidden_size=spec.moe_intermediate_size,
            moe_layer_freq=[1 if i in spec.moe_layers else 0 for i in range(spec.num_layers)],
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_router_fusion=False,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
        )
    return TransformerConfig(**kw)


def build_gpt(spec: ModelSpec, mc: MegatronConfig) -> torch.nn.Module:
    """An uninitialised GPTModel on the current CUDA device (fill it with `weights.load_hf`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = use_te(mc)
    config = transformer_config(spec, mc, te)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=False,  # full-vocab logits on every tensor-parallel rank
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta),
    )
    # megatron's own layers allocate on the GPU, but the torch norms of the local spec
    # (WrappedTorchNorm) are plain modules created on the CPU: megatron's training loop
    # moves the model with .cuda(), so do the same
    model = model.cuda(torch.cuda.current_device())
    _routers_outside_autocast(model)
    return model


def _routers_outside_autocast(model: torch.nn.Module) -> None:
    """Run each MoE router's gating matmul in fp32 with autocast off.

    megatron's router matmul is a custom autograd function without custom_bwd: under
    autocast its forward would return bf16 logits while its backward multiplies the bf16
    gradient with fp32 weights (a dtype error). Router logits in fp32 is also what
    megatron recommends (moe_router_dtype='fp32')."""
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter):
            gating = m.gating

            def fp32_gating(inp: torch.Tensor, _gating: Any = gating) -> torch.Tensor:
                with torch.autocast("cuda", enabled=False):
                    return _gating(inp)

            m.gating = fp32_gating
