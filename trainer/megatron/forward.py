"""One micro-batch through a megatron GPTModel, returning the same `ForwardOut` as FSDP2.

miles packs sequences back to back (`MicroBatch`); megatron's local attention takes no
packed-sequence metadata, so the micro-batch is laid out as B right-padded rows of S
tokens with plain causal attention: a real token never attends to padding (it comes
after), positions restart per row exactly like the packed position ids, and logprobs are
read back at the packed response positions. Logprobs and entropy use the shared
definitions (`token_logprobs`, `entropy_from_logits`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from miles.models.logprobs import token_logprobs
from miles.trainer.forward import ForwardOut
from miles.trainer.kl import entropy_from_logits
from miles.trainer.megatron.replay import MegatronRouting
from miles.trainer.packing import MicroBatch


@dataclass
class Padded:
    """Where packed token n sits in the [B, S] layout: row[n], col[n]."""

    rows: int
    cols: int
    row: torch.Tensor  # [N]
    col: torch.Tensor  # [N]

    @property
    def sb_index(self) -> torch.Tensor:
        """Packed token -> index in megatron's flattened [S, B] token order (routers)."""
        return self.col * self.rows + self.row


def padded_layout(mb: MicroBatch) -> Padded:
    cu = mb.cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    b = int(lens.numel())
    row = torch.repeat_interleave(torch.arange(b, device=cu.device), lens)
    col = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].repeat_interleave(lens)
    return Padded(rows=b, cols=int(lens.max()), row=row, col=col)


def padded_routes(mb: MicroBatch, lay: Padded) -> torch.Tensor | None:
    """[S*B, L, k] recorded expert ids in megatron's token order; padding rows get 0..k-1
    (distinct ids, so every padding token still has k experts; its output is never read)."""
    if mb.routed_experts is None:
        return None
    n, layers, k = mb.routed_experts.shape
    fill = torch.arange(k, device=mb.routed_experts.device).expand(lay.rows * lay.cols, layers, k)
    out = fill.clone()
    out[lay.sb_index] = mb.routed_experts.to(torch.long)
    return out


def mcore_forward(
    model: nn.Module,
    mb: MicroBatch,
    *,
    temperature: float,
    replay: bool,
    with_entropy: bool,
    dtype: torch.dtype,
    routing: MegatronRouting | None = None,
    keep_routes: bool = False,
) -> ForwardOut:
    """Forward one micro-batch on the model's device; `routing` replays/records routes."""
    lay = padded_layout(mb)
    ids = torch.zeros(lay.rows, lay.cols, dtype=torch.long, device=mb.input_ids.device)
    ids[lay.row, lay.col] = mb.input_ids
    pos = torch.arange(lay.cols, device=ids.device).expand(lay.rows, lay.cols)
    if routing is not None:
        routing.begin(padded_routes(mb, lay) if replay else None, keep_routes)
    amp = nullcontext() if dtype == torch.float32 else torch.autocast("cuda", dtype=dtype)
    with amp:
        logits = model(ids, pos, attention_mask=None)  # [B, S, V]
    if routing is not None:
        routing.end(lay.sb_index, lay.rows * lay.cols)
    rp = mb.resp_pos
    sel = logits[lay.row[rp], lay.col[rp]]
    logp = token_logprobs(sel, mb.resp_targets, temperature)
    ent = (
        entropy_from_logits(sel, temperature if temperature > 0 else 1.0) if with_entropy else None
    )
    return ForwardOut(logp=logp, entropy=ent, logits=logits)
