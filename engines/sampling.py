"""Batched next-token choice: greedy or seeded sampling with top-k / top-p, plus reported logprobs.

A request with a seed owns a `torch.Generator`, so its samples do not depend on which
other requests share the batch; each such row costs one kernel per step (its exponential
draw). Requests without a seed (RL rollouts) have nothing to reproduce and draw together
from the engine's generator in one kernel. Softmax, argmax and the logprob gather run once
for the batch, and one copy brings ids and logprobs to the host.
"""

from __future__ import annotations

import torch

from miles.engines.base import SamplingParams
from miles.models.logprobs import scale_logits


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scaled: [V] fp32 -> same with truncated entries set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        vals, idx = torch.sort(scaled, descending=True)
        probs = torch.softmax(vals, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p  # keeps the first token always
        scaled = scaled.scatter(-1, idx, vals.masked_fill(drop, float("-inf")))
    return scaled


def to_device(values: list[int] | list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on `device`; to CUDA through pinned memory without blocking,
    since a plain host-to-device copy waits for the stream, which would stall a pipelined step
    (engines/stepper.py) on the step still running."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids [B] int64, their fp32 logprobs [B] under softmax(logits / T)
    before truncation), on the logits' device and without waiting for it.

    A sampled row draws with its generator (a request with a seed), or without one (no
    seed: nothing to reproduce) from `shared`, in one draw for all such rows."""
    # a plain float when the whole batch shares one temperature (the common case) spares
    # building a per-row tensor and, for greedy / T = 1, the division itself
    distinct = {p.temperature if p.temperature > 0 else 1.0 for p in params}
    if len(distinct) == 1:
        scaled = scale_logits(logits, distinct.pop())
    else:
        temps = to_device([p.temperature for p in params], logits.device, torch.float32)
        scaled = scale_logits(logits, temps.unsqueeze(-1))
    logp = torch.log_softmax(scaled, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if len(rows) == len(params):  # every row samples (RL rollouts): no argmax, no row index
        tokens = _sample(scaled, None, params, generators, shared)
    else:
        tokens = torch.argmax(scaled, dim=-1)
        if rows:
            at = to_device(rows, logits.device, torch.long)
            tokens[at] = _sample(scaled.index_select(0, at), rows, params, generators, shared)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def host_tokens(ids_logps: list[list[float]]) -> tuple[list[int], list[float]]:
    """[[ids as floats], [logprobs]] (one device-to-host copy of both; ids are exact in float64)
    -> (ids, logprobs); a NaN logprob means the model's logits were not finite."""
    ids, lps = ids_logps
    if any(lp != lp for lp in lps):
        raise ValueError("sampling: non-finite logits (NaN logprob of a chosen token)")
    return [int(t) for t in ids], lps


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """`sample_tokens`, brought to the host: (token ids, logprobs)."""
    tokens, chosen = sample_tokens(logits, params, generators, shared)
    if tokens.is_cpu:  # no copy to wait for: two reads, without stacking ops
        return host_tokens([tokens.tolist(), chosen.tolist()])
    return host_tokens(torch.stack((tokens.to(torch.float64), chosen.to(torch.float64))).tolist())


def _sample(
    sub: torch.Tensor,
    rows: list[int] | None,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """Token ids of `rows` (None: every row), whose scaled logits are `sub` (one row each, a
    fresh tensor when rows are picked; else the batch's, which may be the logits themselves),
    each drawn from softmax of its (truncated) scaled logits with its own generator:
    argmax(p / E), E ~ Exp(1) drawn from the row's generator, which is what
    `torch.multinomial(p, 1, generator=g)` computes (the same ids for the same seed), with one
    batched softmax and argmax and no host sync per row (multinomial checks its input with one)."""
    every = rows is None
    rows = list(range(len(params))) if rows is None else rows
    truncated = [j for j, i in enumerate(rows) if params[i].top_k > 0 or params[i].top_p < 1.0]
    if every and truncated:  # truncation writes in place: not into the logits
        sub = sub.clone()
    for j in truncated:
        p = params[rows[j]]
        sub[j] = _truncate(sub[j], p.top_k, p.top_p)
    probs = torch.softmax(sub, dim=-1)
    race = torch.empty_like(probs)
    if any(generators[i] is None for i in rows):  # unseeded rows: one draw for all of them
        race.exponential_(1.0, generator=shared)
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:
            race[j].exponential_(1.0, generator=g)
    return (probs / race).argmax(dim=-1)
