"""True on-policy forward: one sequence per forward, batch-invariant ops.

The engine (with `batch_invariant=True`) samples and reports logprobs under
`miles.models.invariant.BatchInvariant`; this runs the trainer's forward the same way
(each packed sequence alone, unpacked, keys from slot 0), so the trainer's logprobs of
the sampled tokens equal the engine's bit for bit (same dtype, same device kind).

On CUDA, where the invariant ops are single Triton kernels (models/invariant_triton.py) and
every layer attends per sequence on a packed row (models/varlen.py: each sequence's keys
from its own slot 0), the micro-batch runs as ONE packed forward: a row's result does not
depend on the rows beside it, so packing changes nothing. Elsewhere (CPU, sliding windows,
other attention kinds) it costs one forward per sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.models.decoder import CausalLM
from miles.models.invariant import BatchInvariant, triton_kernels
from miles.models.logprobs import token_logprobs
from miles.trainer.forward import ForwardOut, RouterProbe, packed_forward
from miles.trainer.kl import entropy_from_logits
from miles.trainer.packing import MicroBatch


def invariant_forward(
    model: nn.Module,
    mb: MicroBatch,
    *,
    temperature: float,
    replay: bool,
    with_entropy: bool,
    probe: RouterProbe | None = None,
) -> ForwardOut:
    """`packed_forward`'s result, computed per sequence in batch-invariant mode. A `probe`
    watching the routers sees one entry per MoE layer over the whole micro-batch, as after a
    packed forward (the per-sequence entries are joined)."""
    if mb.num_seqs == 0:  # a filler micro-batch only needs a graph
        return packed_forward(
            model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy
        )
    if _packs(model, mb.input_ids.device):
        return _packed(model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy)
    cu = mb.cu_seqlens.tolist()
    seen = len(probe.logits) if probe is not None else 0
    parts = []
    with BatchInvariant():
        for j, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            routes = None
            if replay and mb.routed_experts is not None:
                routes = mb.routed_experts[s:e].unsqueeze(0)
            out = model(mb.input_ids[s:e].unsqueeze(0), routed_experts=routes, **mb.image_kwargs(slice(j, j + 1)))
            parts.append(out.logits[0])
    if probe is not None and len(probe.logits) > seen:
        per_seq = probe.logits[seen:]
        layers = len(per_seq) // len(parts)
        joined = [torch.cat(per_seq[j::layers]) for j in range(layers)]
        probe.logits = probe.logits[:seen] + joined
    logits = torch.cat(parts).unsqueeze(0)
    sel = logits[0, mb.resp_pos]
    logp = token_logprobs(sel, mb.resp_targets, temperature)
    ent = None
    if with_entropy:
        ent = entropy_from_logits(sel, temperature if temperature > 0 else 1.0)
    return ForwardOut(logp=logp, entropy=ent, logits=logits)


def _packs(model: nn.Module, device: torch.device) -> bool:
    """One packed invariant forward is exact here (see the module docstring)."""
    if device.type != "cuda" or not isinstance(model, CausalLM) or triton_kernels() is None:
        return False
    saved, model.packed_attention = model.packed_attention, "varlen"
    try:
        return model._varlen(device)
    finally:
        model.packed_attention = saved


def _packed(model: nn.Module, mb: MicroBatch, *, temperature: float, replay: bool,
            with_entropy: bool) -> ForwardOut:
    assert isinstance(model, CausalLM)
    routes = mb.routed_experts.unsqueeze(0) if replay and mb.routed_experts is not None else None
    saved, model.packed_attention = model.packed_attention, "varlen"
    try:
        with BatchInvariant():
            out = model(mb.input_ids.unsqueeze(0), mb.position_ids.unsqueeze(0), cu_seqlens=mb.cu_seqlens,
                        routed_experts=routes, logits_index=mb.resp_pos, **mb.image_kwargs())
    finally:
        model.packed_attention = saved
    sel = out.logits
    assert sel is not None
    logp = token_logprobs(sel, mb.resp_targets, temperature)
    ent = entropy_from_logits(sel, temperature if temperature > 0 else 1.0) if with_entropy else None
    return ForwardOut(logp=logp, entropy=ent, logits=None)
