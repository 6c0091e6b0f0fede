"""`Sequence`: the torch engine's live state of one request, and how it becomes a `GenerateResult`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import torch

from miles.engines.base import FinishReason, GenerateRequest, GenerateResult
from miles.models.config import ModelSpec
from miles.models.moe import compact_expert_ids, expert_id_dtype


@dataclass
class VLState:
    """A VL request's image features and M-RoPE positions (built by engines/vl_inputs.py)."""

    features: torch.Tensor | None  # [image tokens, hidden] in placeholder order; None: no images
    positions: torch.Tensor  # [3, prompt tokens] int64 (on the host)
    delta: int  # decode position of token i: i + delta on every axis


@dataclass(eq=False)
class Sequence:
    req: GenerateRequest
    future: asyncio.Future[GenerateResult]
    generator: torch.Generator | None
    tokens: list[int]  # prompt + output so far
    n_prompt: int
    cached: int = 0  # prompt tokens restored from the session store
    kv_len: int = 0  # tokens whose KV sits in this sequence's row
    row: int = -1
    # admitted with the same tokens as `share_from`: this row copies its KV and first logits
    # instead of prefilling (engine.share_prompts); None = prefills itself
    share_from: Sequence | None = None
    prompt_key: tuple[int, ...] | None = None  # tokens at admission, when prompt sharing is on
    prompt_version: int = -1  # weight version its prompt KV was computed under
    kv_version: int = -1  # the oldest weight version that wrote any of its KV (saved with a session's)
    block_keys: list[int] = field(default_factory=list)  # its prompt's block hashes while indexed
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_prefix: np.ndarray | None = None  # routing of the cached prefix (from the session)
    routed: list[torch.Tensor] = field(default_factory=list)  # per forward [T_i, L_moe, k]
    finish: FinishReason | None = None
    flushing: bool = False  # finished; fed once more so its last token's KV/routing exist
    abort_requested: bool = False
    done_pending: bool = False  # finished in the worker; the loop finalizes it
    vl: VLState | None = None  # a VL model's image features and M-RoPE positions (engines/vl_inputs.py)

    @property
    def wants_flush(self) -> bool:
        return self.req.return_routed_experts or self.req.session_key is not None

    def routed_array(self, spec: ModelSpec) -> np.ndarray | None:
        """[kv_len, L_moe, k] expert ids of every fed token; [0, L_moe, k] when nothing was fed
        (a request paused or aborted while still queued)."""
        if not self.req.return_routed_experts:
            return None
        parts = [] if self.routed_prefix is None else [self.routed_prefix]
        if self.routed:
            parts.append(compact_expert_ids(torch.cat(self.routed, dim=0), spec.num_experts))
        if not parts:
            shape = (0, spec.num_moe_layers, spec.num_experts_per_tok)
            return np.zeros(shape, dtype=expert_id_dtype(spec.num_experts))
        return np.concatenate(parts, axis=0)[: self.kv_len]

    def result(self, reason: FinishReason, retracted: bool, spec: ModelSpec) -> GenerateResult:
        return GenerateResult(
            request_id=self.req.request_id,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            finish_reason=reason,
            versions=list(self.versions),
            prompt_tokens=self.n_prompt,
            cached_tokens=self.cached,
            retracted=retracted,
            routed_experts=self.routed_array(spec),
        )
