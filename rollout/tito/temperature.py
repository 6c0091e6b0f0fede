"""The sampling temperature a turn is trained under: read from the store's sampling defaults and
the turn's overrides, with truncated sampling (top-p, top-k) refused."""

from __future__ import annotations

from typing import Any

from miles.core.errors import SessionError


def logprob_temperature(t: float) -> float:
    """The temperature a sample's logprobs are taken under: greedy (0) counts as 1 (models/logprobs.py)."""
    return t if t > 0 else 1.0


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise SessionError(f"{what}: expected a number, got {v!r}")
    return float(v)


def turn_temperature(defaults: dict[str, Any], sampling: dict[str, Any] | None = None) -> float:
    """The temperature a turn with these sampling overrides of `defaults` samples at (it travels
    with the sample to the trainer, which takes logprobs under it). Truncated sampling is refused:
    engine and trainer both take logprobs of the untruncated distribution (models/logprobs.py),
    so a top-p/top-k sample would train with importance weights of a policy it was not drawn from."""
    p = {**defaults, **(sampling or {})}
    top_p = _number(p.get("top_p", 1.0), "top_p")
    top_k = _number(p.get("top_k", 0), "top_k")
    if top_p != 1.0 or top_k > 0:
        what = f"top_p={p.get('top_p')}" if top_p != 1.0 else f"top_k={p.get('top_k')}"
        raise SessionError(f"{what}: truncated sampling is not trained on (the trainer's logprobs are of the "
                           "untruncated distribution, so its importance weights would be biased); use "
                           "top_p=1 and top_k=0 or -1")
    t = _number(p.get("temperature", 1.0), "temperature")
    if not 0.0 <= t < float("inf"):
        raise SessionError(f"temperature: expected a finite number >= 0, got {t!r}")
    return t
