"""Config section for the rollout buffer and the orchestration mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt
from miles.core.errors import ConfigError

Schedule = Literal["deadline", "budget", "arrival"]
RetryPolicy = Literal["retry", "discard"]


def check_buffer(capacity: int, batch_groups: int, max_attempts: int, bias_window: int, max_staleness: int,
                 admission_control: bool) -> None:
    """The buffer's own rules (max_staleness -1 = no bound), for the section and for a
    `RolloutBuffer` built without one: one place, one message."""
    sizes = {"capacity": capacity, "batch_groups": batch_groups, "max_attempts": max_attempts,
             "bias_window": bias_window}
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"buffer.{name} must be >= 1, got {value}")
    if max_staleness < -1:
        raise ConfigError(f"buffer.max_staleness must be >= -1 (-1 = no bound), got {max_staleness}")
    if admission_control and max_staleness < 0:
        raise ConfigError("buffer.admission_control needs max_staleness >= 0 (a staleness bound)")


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
    retry: RetryPolicy = opt(
        "retry", "what happens to a prompt dropped for failure or staleness (filter drops are always discarded)"
    )
    max_attempts: int = opt(3, "groups started for one prompt before it is discarded", "attempts")
    schedule: Schedule = opt(
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
        check_buffer(self.capacity, self.batch_groups, self.max_attempts, self.bias_window, self.max_staleness,
                     self.admission_control)


DEFAULTS = BufferConfig()  # the defaults a RolloutBuffer built without a section takes
