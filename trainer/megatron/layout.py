"""HF checkpoint names <-> megatron-core GPTModel parameters, as plain tensor transforms.

A megatron parameter is built from one or more HF tensors by one of five layouts:
  copy  the same tensor (norms, router, biases of row-parallel layers), replicated;
  row   split along dim 0 over tensor-parallel ranks (embedding, output layer);
  col   split along dim 1 (row-parallel `linear_proj`, `linear_fc2`);
  qkv   q, k, v rows regrouped per KV head ([q of group g; k_g; v_g] for g = 0..G-1), so a
        contiguous tensor-parallel split hands each rank whole query groups;
  glu   [gate; up] rows, each half split separately so rank r holds [gate_r; up_r].
Experts (`mlp.experts.local_experts.{j}`) hold global expert `ep_rank * E / ep + j`.

Nothing here imports megatron: the mapping is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

import torch

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec

Kind = Literal["copy", "row", "col", "qkv", "glu"]


@dataclass(frozen=True)
class Target:
    """One megatron parameter and the HF tensors it is made of (in fuse order)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    layer: int = -1  # decoder layer, -1 outside the decoder
    expert: int | None = None  # global expert id of an expert parameter


def local_experts(spec: ModelSpec, ep: int) -> int:
    if spec.num_experts % ep:
        raise ConfigError(
            f"trainer.megatron.expert_parallel_size={ep} does not divide num_experts={spec.num_experts}"
        )
    return spec.num_experts // ep


def expert_hf_names(layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) HF weight names of one expert."""
    pre = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight", f"{pre}.down_proj.weight"


def targets(
    spec: ModelSpec, has: Callable[[str], bool] | Collection[str], ep_rank: int = 0, ep: int = 1
) -> list[Target]:
    """Every megatron parameter of `spec`'s GPTModel on expert-parallel rank `ep_rank`.

    `has` tells which megatron names exist (a set of names or a predicate): it picks the
    Transformer Engine names where TE fuses a norm into the next linear layer.
    """
    exists = has if callable(has) else has.__contains__
    out = [Target("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "row")]
    n_local = local_experts(spec, ep) if spec.is_moe else 0
    for i in range(spec.num_layers):
        d, h = f"decoder.layers.{i}", f"model.layers.{i}"

        def add(mc: str, hf: tuple[str, ...], kind: Kind, expert: int | None = None, i: int = i) -> None:
            out.append(Target(mc, hf, kind, i, expert))

        te_ln = f"{d}.self_attention.linear_qkv.layer_norm_weight"
        add(te_ln if exists(te_ln) else f"{d}.input_layernorm.weight",
            (f"{h}.input_layernorm.weight",), "copy")
        qkv = tuple(f"{h}.self_attn.{p}_proj" for p in "qkv")
        add(f"{d}.self_attention.linear_qkv.weight", tuple(f"{n}.weight" for n in qkv), "qkv")
        if spec.qkv_bias:
            add(f"{d}.self_attention.linear_qkv.bias", tuple(f"{n}.bias" for n in qkv), "qkv")
        add(f"{d}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",), "col")
        if spec.o_bias:
            add(f"{d}.self_attention.linear_proj.bias", (f"{h}.self_attn.o_proj.bias",), "copy")
        if spec.qk_norm:
            add(f"{d}.self_attention.q_layernorm.weight", (f"{h}.self_attn.q_norm.weight",), "copy")
            add(f"{d}.self_attention.k_layernorm.weight", (f"{h}.self_attn.k_norm.weight",), "copy")
        te_mlp_ln = f"{d}.mlp.linear_fc1.layer_norm_weight"
        add(te_mlp_ln if exists(te_mlp_ln) else f"{d}.pre_mlp_layernorm.weight",
            (f"{h}.post_attention_layernorm.weight",), "copy")
        if i in spec.moe_layers:
            add(f"{d}.mlp.router.weight", (f"{h}.mlp.gate.weight",), "copy")
            for j in range(n_local):
                e = ep_rank * n_local + j
                gate, up, down = expert_hf_names(i, e)
                pre = f"{d}.mlp.experts.local_experts.{j}"
                add(f"{pre}.linear_fc1.weight", (gate, up), "glu", e)
                add(f"{pre}.linear_fc2.weight", (down,), "col", e)
            continue
        mlp = f"{h}.mlp"
        add(f"{d}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), "glu")
        add(f"{d}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), "col")
        if spec.mlp_bias:
            add(f"{d}.mlp.linear_fc1.bias", (f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"), "glu")
            add(f"{d}.mlp.linear_fc2.bias", (f"{mlp}.down_proj.bias",), "copy")
    out.append(Target("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not spec.tie_word_embeddings:
        out.append(Target("output_layer.weight", ("lm_head.weight",), "row"))
    return out


# ---------------------------------------------------------------- fusing (full tensors)
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q [nh*hd, ...], k, v [nkv*hd, ...] -> megatron linear_qkv rows, grouped per KV head."""
    g, hd = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g * hd
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], 1)
    return fused.reshape(g * (per + 2 * hd), *rest)


def split_qkv(w: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    g, hd = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g * hd
    rest = w.shape[1:]
    if w.shape[0] != g * (per + 2 * hd):
        raise ConfigError(f"linear_qkv has {w.shape[0]} rows, expected {g * (per + 2 * hd)}")
    grouped = w.reshape(g, per + 2 * hd, *rest)
    q, k, v = grouped.split([per, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse(kind: Kind, parts: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The full (unsharded) megatron tensor from its HF parts."""
    if kind == "qkv":
        return fuse_qkv(parts[0], parts[1], parts[2], spec)
    if kind == "glu":
        return torch.cat(parts, dim=0)
    return parts[0]


def split(kind: Kind, full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of `fuse`: the HF parts of a full megatron tensor."""
    if kind == "qkv":
        return list(split_qkv(full, spec))
    if kind == "glu":
        return list(full.chunk(2, dim=0))
    return [full]


# ---------------------------------------------------------------- tensor parallelism
def _check(n: int, tp: int, what: str) -> None:
    if n % tp:
        raise ConfigError(f"trainer.megatron.tensor_parallel_size={tp} does not divide {what}={n}")


def tp_shard(kind: Kind, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice of a full megatron tensor (a view where possible)."""
    if tp == 1 or kind == "copy" or (kind == "col" and full.dim() == 1):
        return full
    if kind == "col":
        _check(full.shape[1], tp, "columns")
        return full.chunk(tp, dim=1)[rank]
    if kind == "glu":
        gate, up = full.chunk(2, dim=0)
        _check(gate.shape[0], tp, "ffn rows")
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    _check(full.shape[0], tp, "rows")
    return full.chunk(tp, dim=0)[rank]


def tp_unshard(kind: Kind, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_shard` given every rank's slice in rank order."""
    if len(shards) == 1 or kind == "copy" or (kind == "col" and shards[0].dim() == 1):
        return shards[0]
    if kind == "col":
        return torch.cat(shards, dim=1)
    if kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)
