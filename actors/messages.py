"""Wire messages of the role actors (engine, session, buffer, trainer, sync)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.core.generation import GenerateFailed, GenerateResult

# An engine's Health reply, a record: named here so that every process that asks for it can decode it.
from miles.engines.health import HealthReply as HealthReply
from miles.transport.schema import message

# The engine control messages the weight sync sends itself live in weightsync/control.py (weightsync/
# does not import actors/); named here too, as the engine actor and `EngineYield` use them.
from miles.weightsync.control import AbortVersion as AbortVersion
from miles.weightsync.control import Checksums as Checksums
from miles.weightsync.control import Commit as Commit
from miles.weightsync.control import Pause as Pause
from miles.weightsync.control import Resume as Resume

# `Stage`, the one message with tensors, is in weightsync/messages.py: importing torch here
# would load it (~1 s of CPU) into the rollout process, which never touches a tensor.


# ------------------------------------------------------------------ engine
@message("engine.Generate")
@dataclass
class Generate:
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    session_key: str | None = None
    return_routed_experts: bool = False
    request_id: str = ""
    # a VL request's images ({pixels, grid} numpy arrays: zero-copy frames, core/images.py)
    images: dict[str, Any] | None = None


# The replies to Generate / GenerateMany: core's records (the rollout reads them and imports only core),
# registered here so that every process that asks for a generation decodes them, each field checked.
message("engine.GenerateResult")(GenerateResult)
message("engine.GenerateFailed")(GenerateFailed)


@message("engine.GenerateMany")
@dataclass
class GenerateMany:
    """Several `Generate` requests in one message, answered together with one reply each
    (a `GenerateResult`, or a `GenerateFailed` for a request that failed alone). The rollout sends
    a group's samples this way: one message instead of n per group, in both processes."""

    input_ids: list[list[int]]
    sampling: list[dict[str, Any]]
    return_routed_experts: bool = False
    images: list[dict[str, Any] | None] = field(default_factory=list)  # per request; empty = none
    # per request, as Generate.session_key (an HTTP session's turns); empty = none
    session_keys: list[str | None] = field(default_factory=list)


@message("engine.AbortRequest")
@dataclass
class AbortRequest:
    request_id: str


@message("engine.EndSession")
@dataclass
class EndSession:
    key: str


@message("engine.Health")
@dataclass
class Health:
    pass


@message("engine.Stats")
@dataclass
class Stats:
    pass


# ------------------------------------------------------------------ rollout / buffer
@message("rollout.PullBatch")
@dataclass
class PullBatch:
    """Trainer rank -> rollout: data-parallel rank `dp_rank`'s shard of training step `step`'s
    batch (rollout/handout.py; the ranks of one step share one batch)."""

    step: int
    trainer_version: int
    n_groups: int
    dp_rank: int = 0
    dp_size: int = 1


@message("rollout.SetVersion")
@dataclass
class SetVersion:
    """Trainer rank 0 -> rollout: every engine now serves `version`."""

    version: int


@message("rollout.DumpState")
@dataclass
class DumpState:
    pass


@message("rollout.RunEval")
@dataclass
class RunEval:
    """Trainer rank 0 -> rollout (shared eval mode): drain, evaluate on the rollout engines, resume."""

    step: int
    version: int
    full: bool = False  # also greedy-decode every row of the eval set (eval.full_at_ends)
