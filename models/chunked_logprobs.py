"""Per-token logprobs (and entropy) straight from hidden states, through the LM head in chunks.

The unfused path materialises logits [M, V] and then fp32 copies of them for log_softmax,
the gather and the entropy (for a 152k vocabulary and 16k tokens, ~10 GB per fp32 copy,
each read and written several times, forward and backward). Here the head GEMM runs over
chunks of tokens; each chunk's logits are reduced at once to logsumexp, the target logit
and the entropy, in fp32. Definitions are `miles.models.logprobs`' (logprob under
softmax(logits / temperature), temperature <= 0 counting as 1) and the trainer's entropy
of that distribution; both equal the unfused path within fp32 rounding.

Backward is one custom autograd Function: per chunk, d/dz of logp_t = onehot_t - p and of
H = -sum p log p is -p * (log p + H), so
    grad_z = g_lp * onehot_t - p * (g_lp + g_ent * (log p + H)),
and grad_hidden, grad_weight follow from grad_z / temperature by two GEMMs. The chunk's
logits (in the compute dtype: bf16 on GPU, exactly what the forward reduced) are kept for
the backward when all of them fit `SAVE_LOGITS_BYTES` (in one buffer the backward turns
into the logits' gradient, so the two backward GEMMs run once over all rows), else
recomputed chunk by chunk (one more GEMM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Memory, not speed, sets these (issue 44: a 0.5B trainer took 30-37 GB at 16k-token packs). A
# chunk is 2^26 logits: 256 MB per fp32 temporary (~440 rows of a 152k vocabulary, still a full
# GEMM). Logits are kept for the backward only up to 1 GiB (4.3 GB for 14k response tokens of a
# 152k vocabulary before); past that each chunk's GEMM runs again in the backward, ~2 % of a
# 0.5B model's step (one head GEMM of 3 x 6 per token).
CHUNK_ELEMS = 1 << 26  # logits elements per chunk
SAVE_LOGITS_BYTES = 1 << 30  # keep the compute-dtype logits for backward up to this size


def _chunks(m: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMS // max(vocab, 1))
    return [(a, min(a + step, m)) for a in range(0, m, step)]


def _stats(raw: torch.Tensor, tgt: torch.Tensor, t: float, entropy: bool) -> tuple[torch.Tensor, ...]:
    """raw [C, V] logits of a chunk -> (logp of tgt, lse, entropy or empty), fp32, of raw / t.
    In-place on one fp32 copy (a copy even of fp32 logits: they are kept for the backward):
    each step is one pass over the chunk (eager is memory-bound)."""
    z = raw.to(torch.float32, copy=True)
    if t != 1.0:
        z.div_(t)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logp, lse, z.new_empty(0)
    z.sub_(lse.unsqueeze(-1))  # log p
    ent = -(z.exp() * z).sum(-1)  # the unfused form (no lse - E[z] cancellation)
    return logp, lse, ent


def _grad_logits(raw: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                 g_logp: torch.Tensor, g_ent: torch.Tensor | None, t: float) -> torch.Tensor:
    """d(loss)/d(raw logits) of a chunk, in raw's dtype (see the module doc); `g_ent` None when
    the loss does not use the entropy (then its term costs nothing). Works in place on fp32
    `raw` (the kept logits, which the caller overwrites with the result anyway)."""
    z = raw.float()
    if t != 1.0:
        z.div_(t)
    z.sub_(lse.unsqueeze(-1))  # log p
    if g_ent is not None and ent is not None:
        coef = (z + ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1))
        z.exp_().mul_(coef.neg_())
    else:
        z.exp_().mul_(g_logp.neg().unsqueeze(-1))
    z.scatter_add_(-1, tgt.unsqueeze(-1), g_logp.unsqueeze(-1))
    if t != 1.0:
        z.div_(t)
    return z.to(raw.dtype)


@dataclass(frozen=True)
class HeadOps:
    """The per-chunk math: eager, or `torch.compile`d (`compiled_head_ops`) so that a chunk's
    fp32 working set is a couple of fused passes over its logits instead of one per op."""

    stats: Callable[..., tuple[torch.Tensor, ...]]
    grad_logits: Callable[..., torch.Tensor]


EAGER = HeadOps(_stats, _grad_logits)


@functools.cache
def compiled_head_ops(backend: str = "inductor") -> HeadOps:
    return HeadOps(torch.compile(_stats, dynamic=True, backend=backend),
                   torch.compile(_grad_logits, dynamic=True, backend=backend))


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
        temperature: float, entropy: bool, grad: bool, ops: HeadOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused entropy brings no gradient (None), no work
        m, v = hidden.shape[0], weight.shape[0]
        # Kept logits live in one [M, V] buffer that the backward overwrites with the logits'
        # gradient, so grad_hidden and grad_weight are each ONE GEMM over all M rows (as in the
        # unfused path) with no extra memory; recomputed ones go chunk by chunk.
        keep = grad and m * v * hidden.element_size() <= SAVE_LOGITS_BYTES
        buf = hidden.new_empty(m, v) if keep else None
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else logp.new_empty(0)
        for a, b in _chunks(m, v):
            raw = torch.mm(hidden[a:b], weight.t(), out=buf[a:b]) if buf is not None else hidden[a:b] @ weight.t()
            lp, ls, en = ops.stats(raw, targets[a:b], temperature, entropy)
            logp[a:b], lse[a:b] = lp, ls
            if entropy:
                ent[a:b] = en
        ctx.temperature, ctx.entropy, ctx.buf, ctx.ops = temperature, entropy, buf, ops
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        t, buf, ops = ctx.temperature, ctx.buf, ctx.ops
        ctx.buf = None
        m, v = hidden.shape[0], weight.shape[0]
        if g_logp is None:
            g_logp = lse.new_zeros(m)
        use_ent = ctx.entropy and g_ent is not None
        grad_h = grad_w = None
        if buf is None:
            grad_h = torch.empty_like(hidden)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a, b in _chunks(m, v):
            raw = buf[a:b] if buf is not None else hidden[a:b] @ weight.t()
            gl = ops.grad_logits(raw, targets[a:b], lse[a:b], ent[a:b] if use_ent else None,
                                 g_logp[a:b], g_ent[a:b] if use_ent and g_ent is not None else None, t)
            if buf is not None:
                buf[a:b] = gl
                continue
            assert grad_h is not None and grad_w is not None
            grad_h[a:b] = gl @ weight
            if grad_w.dtype == weight.dtype:
                grad_w.addmm_(gl.t(), hidden[a:b])
            else:
                grad_w += (gl.t() @ hidden[a:b]).float()
        if buf is not None:
            return buf @ weight, buf.t() @ hidden, None, None, None, None, None
        assert grad_h is not None and grad_w is not None
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def chunked_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    ops: HeadOps = EAGER,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [M, H] (final, normed), weight [V, H] (the LM head), targets [M] ->
    (logprobs [M] fp32, entropy [M] fp32 or None) under softmax(hidden @ weight.T / temperature).
    """
    t = float(temperature) if temperature > 0 else 1.0
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logp, ent = _ChunkedHead.apply(hidden, weight, targets.long(), t, entropy, grad, ops)
    return logp, (ent if entropy else None)
