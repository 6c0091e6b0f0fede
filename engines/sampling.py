"""Batched next-token choice: greedy or seeded sampling with top-k / top-p, plus reported logprobs.

Every request owns a `torch.Generator`, so its samples do not depend on which other
requests share the batch.
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


def choose_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """logits [B, V] -> (token ids, logprobs under softmax(logits / T) before truncation)."""
    # a plain float when the whole batch shares one temperature (the common case) spares
    # building a per-row tensor and, for greedy / T = 1, the division itself
    distinct = {p.temperature if p.temperature > 0 else 1.0 for p in params}
    if len(distinct) == 1:
        scaled = scale_logits(logits, distinct.pop())
    else:
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        scaled = scale_logits(logits, temps.unsqueeze(-1))
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(scaled, dim=-1)
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.temperature <= 0:
            continue
        probs = torch.softmax(_truncate(scaled[i], p.top_k, p.top_p), dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=g)[0]
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
