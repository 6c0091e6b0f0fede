"""Checks on a `GenerateRequest` before it is queued; each failure is a BadRequest (an EngineError) naming the field."""

from __future__ import annotations

from miles.core.errors import BadRequest
from miles.engines.base import GenerateRequest


def validate_request(req: GenerateRequest, vocab_size: int, max_seq_len: int) -> None:
    rid = req.request_id
    ids = req.input_ids
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"request {rid}: input_ids is empty; a prompt needs at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"request {rid}: input_ids hold {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]!r}"
        )
    if len(ids) >= max_seq_len:
        raise BadRequest(
            f"request {rid}: prompt of {len(ids)} tokens leaves no room under max_seq_len={max_seq_len}"
        )
    s = req.sampling
    if not isinstance(s.max_new_tokens, int) or s.max_new_tokens <= 0:
        raise BadRequest(f"request {rid}: max_new_tokens={s.max_new_tokens!r} must be a positive int")
    if s.temperature < 0:
        raise BadRequest(f"request {rid}: temperature={s.temperature} must be >= 0")
    if not 0 < s.top_p <= 1:
        raise BadRequest(f"request {rid}: top_p={s.top_p} must be in (0, 1]")
    if s.top_k < 0:
        raise BadRequest(f"request {rid}: top_k={s.top_k} must be >= 0 (0 = off)")
    if any(not isinstance(t, int) for t in s.stop_token_ids):
        raise BadRequest(f"request {rid}: stop_token_ids must be ints, got {s.stop_token_ids!r}")
