"""`CausalLM`: the decoder-only LM shared by the engine and the trainer (one forward API).

Parameter names equal the Hugging Face names (`model.layers.3.self_attn.q_proj.weight`, ...)
except fused projections: `self_attn.qkv_proj` (q, k, v rows), `mlp.gate_up_proj` (gate, up
rows) and MoE experts stacked as `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
[E, H, I]; `hf_io.hf_tensor_views` maps HF names to views into them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from miles.core.schema.trainer import Recompute
from miles.models.chunked_logprobs import EAGER, HeadOps, chunked_head_logprobs, compiled_head_ops
from miles.models.compiled_block import CompiledOps, compiled_ops
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.gpt_oss import SinkAttention, TopkSoftmaxMoE
from miles.models.invariant import invariant_active
from miles.models.layers import (
    MLP,
    Attention,
    KVCache,
    RMSNorm,
    eager_cpu_step,
    grouped_bias,
    no_global_hooks,
    plain_forward,
    rms_norm,
)
from miles.models.masks import packed_causal_mask, packed_position_ids, sliding_window_mask
from miles.models.mla import MLAttention
from miles.models.moe import MoEBlock
from miles.models.qwen3_next import GatedAttention, GatedDeltaNet, ZcRMSNorm, zc_rms_norm
from miles.models.rope import Rotary, rotary_tables
from miles.models.varlen import PackedSeqs


@dataclass
class CausalLMOutput:
    """logits: [B, T, V]; [B, 1, V] with `logits_at`; [M, V] with `logits_index`; None when
    `compute_logits=False` or `target_ids`. routed_experts: [B, T, L_moe, k] int64 or None.
    hidden: [B, T, H] final hidden state (after the last norm) when `return_hidden`.
    logprobs / entropy: [M] fp32 from the chunked head when `target_ids` is given."""

    logits: torch.Tensor | None
    routed_experts: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _check_head_args(b: int, logits_at: torch.Tensor | None, logits_index: torch.Tensor | None) -> None:
    if logits_at is not None and logits_index is not None:
        raise ModelInputError("pass either logits_at or logits_index, not both")
    if logits_at is not None and tuple(logits_at.shape) != (b,):
        raise ModelInputError(f"logits_at must have shape [B]=({b},), got {tuple(logits_at.shape)}")
    if logits_index is not None and logits_index.dim() != 1:
        raise ModelInputError(f"logits_index must be 1-D [M], got shape {tuple(logits_index.shape)}")


def _fp8_planned(mlp: MLP) -> bool:
    """Whether an FP8 plan (models/fp8_linear.py `project`) runs this MLP's linears."""
    return any(getattr(m, "fp8_plan", None) is not None for m in (mlp.gate_up_proj, mlp.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.linear = layer in spec.linear_layers
        if self.linear:
            self.linear_attn = GatedDeltaNet(spec, layer)
        else:
            self.self_attn: nn.Module = (
                MLAttention(spec, layer) if spec.mla
                else SinkAttention(spec, layer) if spec.model_type == "gpt_oss"
                else GatedAttention(spec, layer) if spec.model_type == "qwen3_next"
                else Attention(spec, layer)
            )
        self.sliding = layer in spec.sliding_layers
        self.is_moe = layer in spec.moe_layers
        self.mlp: nn.Module = (
            TopkSoftmaxMoE(spec)
            if self.is_moe and spec.router == "topk_softmax"
            else MoEBlock(spec)
            if self.is_moe
            else MLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        )
        zc = spec.model_type == "qwen3_next"  # zero-centred norms: weight + 1 scales
        norm = ZcRMSNorm if zc else RMSNorm
        self.input_layernorm: RMSNorm | ZcRMSNorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm: RMSNorm | ZcRMSNorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self._norm = zc_rms_norm if zc else rms_norm
        self.ops: CompiledOps | None = None  # set by `CausalLM.compile_blocks`
        self.recompute = "off"  # activation checkpointing: off | mlp | full (`CausalLM.set_recompute`)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        given_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        direct: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [B, T, H] -> (new h [B, T, H], expert ids [B, T, k] for a MoE layer else None).
        direct: the CPU engine's eager step (`CausalLM.forward`): submodules' forwards are called
        directly (`plain_forward`).

        Under `recompute = "full"` (training only) the block keeps just its input for the
        backward and runs again there; the checkpoint sits inside this module's forward, so
        FSDP2's hooks around it gather the weights once for both runs."""
        if self.recompute == "full" and kv_cache is None and torch.is_grad_enabled():
            out: tuple[torch.Tensor, torch.Tensor | None] = checkpoint(
                self._block, h, cos, sin, bias, kv_cache, given_ids, position_ids, use_reentrant=False)
            return out
        return self._block(h, cos, sin, bias, kv_cache, given_ids, position_ids, direct)

    def _block(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | None,
        kv_cache: KVCache | None,
        given_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        direct: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's computation (see `forward`).

        A real forward (rather than the LM reaching into the block) so that FSDP2 can shard
        one unit per block: its pre-forward hook gathers exactly this block's weights.
        """
        ln1, ln2, norm = self.input_layernorm, self.post_attention_layernorm, self._norm
        ops = self.ops if not invariant_active() else None  # invariant kernels intercept eager ops
        x = (ops.norm if ops is not None else norm)(h, ln1.weight, ln1.eps)
        if self.linear:
            assert position_ids is not None
            a = self.linear_attn(x, position_ids, kv_cache)
        else:
            a = (plain_forward(self.self_attn) if direct else self.self_attn)(x, cos, sin, bias, kv_cache)
        if ops is not None:
            h, x = ops.add_norm(h, a, ln2.weight, ln2.eps)
        else:
            h = h + a
            x = norm(h, ln2.weight, ln2.eps)
        if self.recompute == "mlp" and kv_cache is None and torch.is_grad_enabled():
            # selective: the MLP's [tokens, 2 x inter] activations (or the experts') are the
            # block's largest; only its input is kept and the MLP runs again in the backward
            out: tuple[torch.Tensor, torch.Tensor | None] = checkpoint(
                self._mlp_residual, h, x, given_ids, ops, use_reentrant=False)
            return out
        return self._mlp_residual(h, x, given_ids, ops, direct)

    def _mlp_residual(self, h: torch.Tensor, x: torch.Tensor, given_ids: torch.Tensor | None,
                      ops: CompiledOps | None, direct: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        mlp = plain_forward(self.mlp) if direct else self.mlp
        if self.is_moe:
            y, ids = mlp(x, given_ids)
            return h + y, ids
        if ops is not None and type(self.mlp) is MLP and not _fp8_planned(self.mlp):
            gu, down = self.mlp.gate_up_proj, self.mlp.down_proj
            return ops.swiglu_residual(h, x, gu.weight, gu.bias, down.weight, down.bias), None
        return h + mlp(x), None


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm: nn.Module = (ZcRMSNorm if spec.model_type == "qwen3_next" else RMSNorm)(
            spec.hidden_size, spec.rms_norm_eps
        )
        self.rotary: nn.Module = Rotary(spec.rope_spec)  # VLCausalLM puts an MRotary here


# H200, 0.5B dense (bench/results/trainer_h200_s4.txt): 4k-token packs of 768-token sequences
# train at 0.87x with varlen (launches and a host sync outweigh a small mask); 16k-token packs
# of 2k-token sequences at 1.73x (the [groups*T, T] bias is 3.6 GB there). With varlen as one
# flash call (trainer_h200_s6.txt) 4k-token packs still train at 0.90x masked. Between the two:
VARLEN_AUTO_MIN_TOKENS = 8192


class CausalLM(nn.Module):
    """A Llama / Qwen2 / Qwen3 / Qwen3-MoE / GLM-4.5 (glm4_moe) / DeepSeek-V3 / gpt-oss decoder
    LM built from a `ModelSpec`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = (
            None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        )
        # how packed rows attend: varlen | masked | by_length (`_varlen`; trainer.packed_attention)
        self.packed_attention = "by_length"
        self.head_ops: HeadOps = EAGER  # the chunked head's per-chunk math (`compile_blocks`)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> None:
        """Random init (normal(0, std) for matrices, ones for norms, zeros for biases), seeded."""
        std = float(self.spec.hf_config.get("initializer_range", 0.02)) if std is None else std
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        for m in self.modules():
            if isinstance(m, ZcRMSNorm):  # scale 1 + weight: weight 0 is the identity scale
                m.weight.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        routed_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        logits_at: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        return_hidden: bool = False,
        compute_logits: bool = True,
        target_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Run the LM.

        input_ids: LongTensor [B, T].
        position_ids: LongTensor [B, T]; default arange(T) per row, or restarting per packed
            sequence when `cu_seqlens` is given.
        Attention layout, one of:
          - nothing: plain causal over T (every row a full sequence, no padding);
          - cu_seqlens: IntTensor [n+1] (B must be 1): packed sequences, block-diagonal causal;
          - attention_mask: BoolTensor [B, 1, T, S], True = may attend (see `miles.models.masks`
            for padded and KV-cached layouts); S = T without a cache, cached + T with one.
            With a cache and T = 1 it may be omitted when every row attends to all S keys.
        kv_cache: a `KVCache` (engine); keys/values of this call are appended to it.
        routed_experts: int tensor [B, T, L_moe, k] (R3 replay): these expert ids are used
            instead of the router's top-k in MoE layer j = routed_experts[:, :, j]; gate weights
            are the live router softmax gathered at those ids.
        return_routed_experts: also return the ids used, [B, T, L_moe, k] int64.
        logits_at: LongTensor [B]: compute logits only at this position of each row -> [B, 1, V].
        logits_index: LongTensor [M]: compute logits only at these positions of the flattened
            [B*T] token axis (packed training: the response positions) -> [M, V].
        return_hidden: also return the final hidden state [B, T, H] (after the last norm);
            `logits_from_hidden` turns (a selection of) it into logits.
        compute_logits: False skips the LM head (logits = None), e.g. to chunk it yourself.
        target_ids: LongTensor [M] with `logits_index` (or [B*T] without): instead of logits,
            the per-token logprobs of these tokens under softmax(logits / temperature)
            (`out.logprobs`, and `out.entropy` with `return_entropy`), computed by the chunked
            head (models/chunked_logprobs.py) without materialising [M, V] logits.
        inputs_embeds: [B, T, H] used instead of the token embeddings (a VL model's image
            features scattered in, models/qwen2_5_vl.py); input_ids still give the shape.
        rope_position_ids: [3, B, T] multimodal rotary positions (M-RoPE) for the rotary tables;
            position_ids keep giving the sequence index for masks and windows.
        """
        spec = self.spec
        if input_ids.dim() != 2:
            raise ModelInputError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        packed: PackedSeqs | None = None
        if cu_seqlens is not None:
            if b != 1:
                raise ModelInputError(f"cu_seqlens needs a packed batch with B=1, got B={b}")
            if attention_mask is not None:
                raise ModelInputError("pass either cu_seqlens or attention_mask, not both")
            if self._varlen(input_ids.device, t):
                packed = PackedSeqs.of(cu_seqlens)
            else:
                attention_mask = packed_causal_mask(cu_seqlens.to(input_ids.device), t)
            if position_ids is None:
                position_ids = packed_position_ids(cu_seqlens.to(input_ids.device), t)
        if kv_cache is not None and attention_mask is None and t > 1:
            raise ModelInputError(f"a forward over a KV cache with T={t} new tokens needs attention_mask")
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        if position_ids.shape != input_ids.shape:
            raise ModelInputError(
                f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if routed_experts is not None:
            want = (b, t, spec.num_moe_layers, spec.num_experts_per_tok)
            if tuple(routed_experts.shape) != want:
                raise ModelInputError(
                    f"routed_experts shape {tuple(routed_experts.shape)} != expected [B, T, L_moe, k] = {want}"
                )
            # range-checked on the host only: on a GPU `.max()` would sync every forward and
            # stall the launch queue (the trainer checks its replayed ids on the host, trainer/batch.py)
            on_host = routed_experts.device.type == "cpu"
            if on_host and routed_experts.numel() and int(routed_experts.max()) >= spec.num_experts:
                raise ModelInputError(
                    f"routed_experts holds expert id {int(routed_experts.max())} >= num_experts={spec.num_experts}"
                )
        _check_head_args(b, logits_at, logits_index)
        if target_ids is not None:
            m = logits_index.numel() if logits_index is not None else b * t
            if logits_at is not None or tuple(target_ids.shape) != (m,):
                raise ModelInputError(
                    f"target_ids must be [M]=({m},) matching logits_index (not logits_at), "
                    f"got shape {tuple(target_ids.shape)}"
                )
        # the CPU engine's eager step: modules' forwards called directly (`plain_forward`)
        direct = kv_cache is not None and eager_cpu_step(input_ids) and no_global_hooks()
        if inputs_embeds is None:
            embed = self.model.embed_tokens
            h = (plain_forward(embed) if direct else embed)(input_ids)
        else:
            h = inputs_embeds
        bias: torch.Tensor | PackedSeqs | None = packed
        window_bias = None
        if attention_mask is not None:
            bias = grouped_bias(attention_mask.to(torch.bool), spec.attn_groups, h.dtype)
        if spec.sliding_layers:
            window = sliding_window_mask(attention_mask, position_ids, kv_cache is not None, spec.sliding_window)
            window_bias = grouped_bias(window, spec.attn_groups, h.dtype)
        rotary = self.model.rotary
        if (not torch.compiler.is_compiling() and kv_cache is not None and h.is_cpu
                and rope_position_ids is None and type(rotary) is Rotary and rotary.rope.rope_type != "dynamic"
                and not invariant_active()):
            cos, sin = rotary.lookup(position_ids, h.dtype)  # the CPU engine's steps: a table lookup
        else:
            rope_pos = position_ids if rope_position_ids is None else rope_position_ids
            cos, sin = rotary_tables(*rotary(rope_pos, h.dtype))
        used: list[torch.Tensor] = []
        j = 0
        for layer in self.model.layers:
            given = None
            if layer.is_moe:
                given = routed_experts[:, :, j] if routed_experts is not None else None
                j += 1
            lb = window_bias if layer.sliding else bias
            if direct:
                h, ids = plain_forward(layer)(h, cos, sin, lb, kv_cache, given, position_ids, True)
            else:
                h, ids = layer(h, cos, sin, lb, kv_cache, given, position_ids)
            if return_routed_experts and ids is not None:
                used.append(ids)
        logp: torch.Tensor | None
        ent: torch.Tensor | None
        if target_ids is not None:
            flat = h.reshape(b * t, -1)
            sel = flat[logits_index.to(h.device)] if logits_index is not None else flat
            ops = self.head_ops if not invariant_active() else EAGER
            logp, ent = chunked_head_logprobs(self.model.norm(sel), self._head_weight(),
                                              target_ids.to(h.device), temperature, return_entropy, ops)
            hidden = self.model.norm(h) if return_hidden else None
            logits = None
        else:
            logits, hidden = self._head(h, logits_at, logits_index, return_hidden, compute_logits)
            logp = ent = None
        out_ids = None
        if return_routed_experts:
            k = spec.num_experts_per_tok
            out_ids = (
                torch.stack(used, dim=2)
                if used
                else torch.zeros(b, t, 0, k, dtype=torch.long, device=input_ids.device)
            )
        return CausalLMOutput(logits=logits, routed_experts=out_ids, hidden=hidden, logprobs=logp, entropy=ent)

    def compile_blocks(self, backend: str = "inductor") -> None:
        """Run each block's norms, residual adds and dense SwiGLU MLP as `torch.compile`d
        fused kernels (models/compiled_block.py), and the chunked head's per-chunk softmax math
        (models/chunked_logprobs.py); attention and MoE dispatch stay eager.
        Numerics are the same ops, fused: equal up to floating-point rounding. Only on CUDA
        does it pay (Triton kernels); the first forward compiles (tens of seconds)."""
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            layer.ops = compiled_ops(layer._norm, backend)
        self.head_ops = compiled_head_ops(backend)

    def set_recompute(self, mode: Recompute, layers: int = 0) -> None:
        """Activation checkpointing for training: `mode` off | mlp (each block's MLP or experts
        run again in the backward, keeping only their input) | full (whole blocks); on the
        first `layers` blocks, 0 = all. Same ops, same order: gradients are unchanged."""
        if layers < 0:
            raise ModelInputError(f"recompute layers must be >= 0 (0 = every block), got {layers}")
        n = layers or len(self.model.layers)
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):
            layer.recompute = mode if i < n else "off"

    def _varlen(self, device: torch.device, t: int = VARLEN_AUTO_MIN_TOKENS) -> bool:
        """Packed rows through per-sequence attention (models/varlen.py) instead of a mask:
        `packed_attention` = varlen | masked | by_length (varlen on CUDA for packs of at least
        VARLEN_AUTO_MIN_TOKENS, where it reaches the flash kernels and the mask would be large;
        masked otherwise). Only the plain attention layer takes it; sliding windows and the
        other attention kinds use the mask."""
        mode = self.packed_attention
        short = mode == "by_length" and (device.type != "cuda" or t < VARLEN_AUTO_MIN_TOKENS)
        if mode == "masked" or short or self.spec.sliding_layers:
            return False
        return all(type(getattr(layer, "self_attn", None)) is Attention for layer in self.model.layers)

    def _head(
        self,
        h: torch.Tensor,
        logits_at: torch.Tensor | None,
        logits_index: torch.Tensor | None,
        return_hidden: bool,
        compute_logits: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        b, t, _ = h.shape
        hidden = None
        if return_hidden:
            hidden = h = self.model.norm(h)
        elif not compute_logits:
            return None, None
        # Select before the norm when the full hidden state is not wanted: the norm is per token.
        if logits_at is not None:
            h = h[torch.arange(b, device=h.device), logits_at.to(h.device)].unsqueeze(1)
        elif logits_index is not None:
            h = h.reshape(b * t, -1)[logits_index.to(h.device)]
        if not compute_logits:
            return None, hidden
        if hidden is None:
            h = self.model.norm(h)
        return self._project(h), hidden

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self._head_weight().t()

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from final (already normed) hidden states [..., H], e.g. `out.hidden`
        or a selection of it."""
        return self._project(hidden)
