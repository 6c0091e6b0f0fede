"""An engine's answer to one generation request: the record the engine returns, the engine
actor sends and the rollout reads, one type end to end.

It lives in core because both ends import it and the rollout may import only core; the wire
registers it in actors/messages.py (`engine.GenerateResult`, `engine.GenerateFailed`), so a
reply is decoded into this record with every field checked (a wrong type, a finish reason
outside `FinishReason`, a missing field is a ProtocolError naming the field), never read from
a map by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from miles.core.errors import remote_exception

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerateResult:
    request_id: str
    output_ids: list[int]
    logprobs: list[float]  # one per output token, definition in engines/base.py
    finish_reason: FinishReason
    versions: list[int]  # weight version that produced each output token
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused from the session cache
    retracted: bool = False  # aborted by pause('retract'): resubmit prompt + output to continue
    # [T, L_moe, k] expert ids (uint8 / uint16) for the prompt + output tokens fed to the model:
    # T = prompt_tokens + len(output_ids) normally; one less when the request was aborted.
    routed_experts: np.ndarray | None = None


@dataclass
class GenerateFailed:
    """One request of a `GenerateMany` that failed alone (the others of the message stand):
    the error's class name and message, as an ask of that request alone would have raised."""

    error_type: str
    error: str

    def exception(self) -> Exception:
        return remote_exception(self.error_type, self.error)

    @classmethod
    def of(cls, exc: Exception) -> GenerateFailed:
        return cls(type(exc).__name__, str(exc))
