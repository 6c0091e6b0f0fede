"""Config section for the rollout buffer and the orchestration mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt


@dataclass
class BufferConfig:
    mode: Literal["sync", "one_step_off", "fully_async"] = opt(
        "fully_async",
        "sync: generate a batch then train; one_step_off: generate batch k+1 while training on k; "
        "fully_async: generation never waits for training (bounded by capacity and staleness)",
    )
    capacity: int = opt(
        64,
        "generation slots: trajectories generating at once; a finished trajectory frees its slot and new "
        "work starts in it at once (the seed's walkthrough calls this capacity 'groups')",
        "trajectories",
    )
    max_waiting: int = opt(
        0, "most finished groups waiting for the trainer before new groups pause; 0 = max(capacity, batch)",
        "groups",
    )
    batch_groups: int = opt(8, "groups the trainer takes per step (oldest finished first)", "groups")
    max_staleness: int = opt(
        1,
        "drop a group at collection when trainer version - oldest sampled-token version exceeds this; "
        "-1 = never drop for staleness",
        "versions",
    )
    retry: Literal["retry", "discard"] = opt(
        "retry", "what happens to a prompt dropped for failure or staleness (filter drops are always discarded)"
    )
    max_attempts: int = opt(3, "groups started for one prompt before it is discarded", "attempts")
    schedule: Literal["deadline", "budget", "arrival"] = opt(
        "deadline",
        "fully_async only. deadline: admit a group while groups outstanding + taken this version < "
        "(max_staleness + 1) * batch_groups and this version's batch is not yet complete, and train each by version admitted + max_staleness (the trainer "
        "waits only for a group that would otherwise go stale): no stale drops, no bias toward short "
        "rollouts (docs/orchestration.md). budget: the same admission, arrival order, never a stale drop (as "
        "AReaL): more throughput when generation is the bottleneck, but a long group's oldest tokens may be "
        "older than max_staleness. arrival: train the oldest finished groups, drop stale ones at collection "
        "(the old behaviour; see admission_control). With max_staleness = -1 all three are arrival",
    )
    admission_control: bool = opt(
        False,
        "schedule 'arrival' only ('deadline' and 'budget' always admit this way): do not start new groups "
        "while groups in flight + waiting reach (max_staleness + 1) * batch_groups; fewer stale drops than "
        "discard-and-retry alone, but short groups still overtake long ones and go stale",
    )
    bias_window: int = opt(
        8, "steps over which rollout/fully_async/len_ratio compares trained and generated response lengths",
        "steps",
    )
    filter_fn: str = opt(
        "",
        "import path of `(group: Group) -> (keep: bool, reason: str)` checked on arrival; drops are "
        "logged as rollout/dynamic_filter/drop_<reason>; e.g. miles.rollout.filters:dynamic_sampling",
    )

    def __post_init__(self) -> None:
        for name in ("capacity", "batch_groups", "max_attempts", "bias_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < -1:
            raise ValueError(f"max_staleness must be >= -1, got {self.max_staleness}")
        if self.admission_control and self.max_staleness < 0:
            raise ValueError("admission_control needs max_staleness >= 0")
