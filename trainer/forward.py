"""One packed forward pass of the policy: response-token logprobs, entropy, routing overlap.

Logprobs use the definition of `miles.models.logprobs.token_logprobs`, the one the engine
reports, so engine and trainer numbers are comparable token for token; they come from the
model's chunked head (models/chunked_logprobs.py: response positions only, no [N, V]
logits), equal to the unfused path within fp32 rounding. With replay on,
the micro-batch's recorded expert ids drive every MoE layer (R3); a `RouterProbe` can
also watch each router's live choice to measure how far live routing has drifted from
the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from miles.models.logprobs import token_logprobs
from miles.trainer.kl import entropy_from_logits
from miles.trainer.packing import MicroBatch


@dataclass
class ForwardOut:
    logp: torch.Tensor  # [M] fp32
    entropy: torch.Tensor | None  # [M] fp32
    logits: torch.Tensor | None  # [1, N, V] for fillers (num_seqs == 0); None from the fused head
    # [N]: where each packed token sat in the padded [S * L] layout (`padded_forward`); None when packed
    token_index: torch.Tensor | None = None


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The router (gate) of every MoE layer, in layer order."""
    lm: Any = model  # a CausalLM (or a wrapper): its submodules are attributes torch does not type
    layers = lm.model.layers
    return [layer.mlp.gate for layer in layers if getattr(layer, "is_moe", False)]


class RouterProbe:
    """Records each MoE router's live logits during a forward (a forward hook per gate)."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self._handles: list[RemovableHandle] = [
            g.register_forward_hook(self._hook) for g in moe_gates(model)
        ]
        self.active = False

    def _hook(self, _m: nn.Module, _inp: object, out: torch.Tensor) -> None:
        if self.active:
            self.logits.append(out.detach())

    def overlap(
        self, recorded: torch.Tensor, topk: int, valid: torch.Tensor | None = None
    ) -> tuple[float, float]:
        """(sum over tokens x layers of |live top-k ∩ recorded| / k, count) since the last reset;
        `valid` [N] excludes padded route rows."""
        if not self.logits:
            return 0.0, 0.0
        tot, cnt = 0.0, 0.0
        rec = recorded.to(self.logits[0].device)
        for j, lg in enumerate(self.logits):
            live = torch.topk(lg.float(), topk, dim=-1).indices  # [N, k]
            r = rec[:, j, :]
            hit = (live[:, :, None] == r[:, None, :]).any(-1).float().sum(-1) / topk
            if valid is not None:
                hit = hit[valid.to(hit.device)]
            tot += float(hit.sum())
            cnt += float(hit.numel())
        return tot, cnt

    def select(self, token_index: torch.Tensor | None) -> None:
        """Put the recorded logits in packed token order, after a padded forward (`token_index`
        from its ForwardOut; None: already packed)."""
        if token_index is not None:
            self.logits = [lg.reshape(-1, lg.shape[-1])[token_index] for lg in self.logits]

    def reset(self) -> None:
        self.logits = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def packed_forward(
    model: nn.Module,
    mb: MicroBatch,
    *,
    temperature: float,
    replay: bool,
    with_entropy: bool,
    fused_head: bool = True,
) -> ForwardOut:
    """Forward one micro-batch (B = 1, sequences packed) on the micro-batch's device.

    Real micro-batches go through the chunked head (logprobs and entropy at the response
    positions only, no [N, V] logits); a filler (no sequences) returns its full logits, whose
    zero-weighted sum gives every parameter a gradient on this rank."""
    routes = mb.routed_experts.unsqueeze(0) if replay and mb.routed_experts is not None else None
    if mb.num_seqs and fused_head:
        out = model(
            mb.input_ids.unsqueeze(0),
            mb.position_ids.unsqueeze(0),
            cu_seqlens=mb.cu_seqlens,
            routed_experts=routes,
            logits_index=mb.resp_pos,
            target_ids=mb.resp_targets,
            temperature=temperature,
            return_entropy=with_entropy,
            **mb.image_kwargs(),
        )
        return ForwardOut(logp=out.logprobs, entropy=out.entropy, logits=None)
    out = model(
        mb.input_ids.unsqueeze(0),
        mb.position_ids.unsqueeze(0),
        cu_seqlens=mb.cu_seqlens,
        routed_experts=routes,
        **mb.image_kwargs(),
    )
    logits = out.logits
    sel = logits[0, mb.resp_pos]
    logp = token_logprobs(sel, mb.resp_targets, temperature)
    ent = (
        entropy_from_logits(sel, temperature if temperature > 0 else 1.0) if with_entropy else None
    )
    return ForwardOut(logp=logp, entropy=ent, logits=logits)


def padded_layout(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [S, L], position ids [S, L], token index [N]): the packed row as one row per
    sequence, right-padded to the longest (L); token index = row * L + position of each packed
    token. Pad positions hold token 0 and come after every real token of their row, so causal
    attention keeps them out of the real tokens' results."""
    cu = mb.cu_seqlens.to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    s, width = int(lens.numel()), int(lens.max())
    dev = mb.input_ids.device
    rows = torch.repeat_interleave(torch.arange(s, device=dev), lens.to(dev))
    index = rows * width + mb.position_ids
    ids = mb.input_ids.new_zeros(s * width).index_copy_(0, index, mb.input_ids).view(s, width)
    pos = torch.arange(width, device=dev).expand(s, width)
    return ids, pos, index


def padded_forward(
    model: nn.Module,
    mb: MicroBatch,
    *,
    temperature: float,
    replay: bool,
    with_entropy: bool,
) -> ForwardOut:
    """`packed_forward` with the micro-batch's sequences as padded rows instead of one packed row
    (trainer.packed_attention = 'padded'): plain causal attention over [S, L], a handful of kernel
    calls however many sequences, paid for with the padding's compute. Same quantities, equal
    within fp32 rounding; a filler (no sequences) goes through `packed_forward`."""
    if not mb.num_seqs:
        return packed_forward(model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy)
    ids, pos, index = padded_layout(mb)
    routes = None
    if replay and mb.routed_experts is not None:
        r = mb.routed_experts
        # pad rows route to expert 0; their outputs reach no real token
        routes = r.new_zeros((ids.numel(), *r.shape[1:])).index_copy_(0, index, r).view(*ids.shape, *r.shape[1:])
    out = model(
        ids,
        pos,
        routed_experts=routes,
        logits_index=index[mb.resp_pos],
        target_ids=mb.resp_targets,
        temperature=temperature,
        return_entropy=with_entropy,
        **mb.image_kwargs(),
    )
    return ForwardOut(logp=out.logprobs, entropy=out.entropy, logits=None, token_index=index)
