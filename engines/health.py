"""An engine's answer to `Health`, as a typed record on the wire.

Its own module, with no torch import: every process that may receive it (the rollout, whose
watchers ask down engines and judges for it, and the trainer) registers the record by importing
actors/messages.py, which names it, and the rollout process never loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.transport.schema import message


@message("engine.HealthReply")
@dataclass
class HealthReply:
    """An engine's answer to `Health`, a typed record on the wire (its fields checked where it is
    decoded): the weight version, whether it serves, and its load; an external server
    (engines/sglang.py) adds its restarts, why it cannot serve (`fatal`, "" when it can) and how
    it takes weights."""

    version: int  # the weight version it serves
    ok: bool  # serving: alive, not closed, nothing fatal
    paused: bool
    running: int  # requests decoding
    queued: int  # requests waiting for a row
    device: str = ""
    last_error: str = ""  # "" when none
    restarts: int = 0  # an external server's restarts
    fatal: str = ""  # why it cannot serve; "" when it can
    weight_update: str = ""  # how an external server takes weights (engines/sglang_update.py)
