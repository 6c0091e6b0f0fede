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


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The router (gate) of every MoE layer, in layer order."""
    layers = model.model.layers  # type: ignore[union-attr]
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
        )
        return ForwardOut(logp=out.logprobs, entropy=out.entropy, logits=None)
    out = model(
        mb.input_ids.unsqueeze(0),
        mb.position_ids.unsqueeze(0),
        cu_seqlens=mb.cu_seqlens,
        routed_experts=routes,
    )
    logits = out.logits
    sel = logits[0, mb.resp_pos]
    logp = token_logprobs(sel, mb.resp_targets, temperature)
    ent = (
        entropy_from_logits(sel, temperature if temperature > 0 else 1.0) if with_entropy else None
    )
    return ForwardOut(logp=logp, entropy=ent, logits=logits)
