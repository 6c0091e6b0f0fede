"""The check of an engine's output for one turn before the store keeps it: as many logprobs and
versions as sampled ids, a known finish reason, and routed experts of a shape that covers the
turn's segment (its spliced prompt ids plus the sampled ones)."""

from __future__ import annotations

import numpy as np

from miles.core.errors import SessionError

FINISH_REASONS = ("stop", "length", "abort", "error")


def checked_output(pid: str, n_prompt: int, n_new: int, sampled_ids: list[int], logprobs: list[float],
                   routed_experts: np.ndarray | None, versions: int | list[int],
                   finish_reason: str) -> tuple[list[int], list[int], np.ndarray | None]:
    """The engine's output of one turn, checked: (sampled ids, per-token versions, the routed
    experts of this turn's segment: its `n_new` spliced prompt ids plus the sampled ones)."""
    sampled = [int(x) for x in sampled_ids]
    n = len(sampled)
    if len(logprobs) != n:
        raise SessionError(f"commit {pid}: {len(logprobs)} logprobs for {n} sampled tokens")
    vers = [int(versions)] * n if isinstance(versions, int) else [int(v) for v in versions]
    if len(vers) != n:
        raise SessionError(f"commit {pid}: {len(vers)} versions for {n} sampled tokens")
    if finish_reason not in FINISH_REASONS:
        raise SessionError(f"commit {pid}: finish_reason {finish_reason!r} not in {', '.join(FINISH_REASONS)}")
    seg_len = n_new + n
    experts = None
    if routed_experts is not None:
        ex = np.asarray(routed_experts)
        total = n_prompt + n
        if ex.ndim == 3 and n and 0 < ex.shape[0] and ex.shape[0] + 1 in (seg_len, total):
            # An engine that never feeds the last sampled token (SGLang; an aborted request of any
            # engine) has no row for it: repeat the last one. Only that token's own position reads
            # it in the replay, and no loss reads that position's output (engines/base.py).
            ex = np.concatenate([ex, ex[-1:]])
        if ex.ndim != 3 or ex.shape[0] not in (seg_len, total):
            raise SessionError(f"commit {pid}: routed_experts has shape {list(ex.shape)}; expected "
                               f"[{total} or {seg_len}, layers, k] (whole sequence or the new tokens, "
                               "or one row less)")
        experts = ex[-seg_len:] if seg_len else ex[:0]
    return sampled, vers, experts
