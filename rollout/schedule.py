"""Deadline scheduling of fully_async groups: no group is ever trained too stale to keep.

Why: with groups trained in arrival order, short groups finish first and are trained
first; a long group started at version v is overtaken until the trainer's version
passes v + max_staleness and it is dropped as stale (and retried, still long). The
trainer then sees a sample biased toward short responses, and the generation spent on
dropped groups is wasted (57% of the completions on the CPU quick start).

The rule (an earliest-deadline-first schedule with the admission test that makes it
feasible, as AReaL bounds staleness by admission rather than by dropping):
- admission: a group admitted while the rollout side knows version v gets the deadline
  v + max_staleness. A new group is admitted only while the groups outstanding
  (admitted, not yet trained or dropped) plus those already taken at version v stay
  below (max_staleness + 1) * batch_groups: the steps v .. v + max_staleness can train
  all of them; and none is admitted while version v's batch is complete (the trainer is
  training it), so new groups start with the next version's later deadline (`admits`);
- collection: the trainer takes finished groups oldest-admitted first, but waits for an
  unfinished one when skipping it would leave more groups due by some deadline d than
  the steps up to d can take (`plan`). It waits for nothing else, so a batch is held up
  only by a group that would otherwise go stale - the bounded wait.

Every admitted group is then trained by its deadline (its tokens are sampled at a
version >= its admission version), so none is dropped as stale and the trained lengths
follow the generated ones. The cost: the engines may run ahead of the trainer by at
most max_staleness + 1 batches, and a step may wait for a long group near its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Outstanding(Generic[T]):
    """An admitted group as the planner sees it: its deadline and, once finished, the group."""

    seq: int  # admission order
    deadline: int  # latest trainer version that may train it
    done: T | None  # the finished group, None while generating


def admits(outstanding: int, taken_this_version: int, max_staleness: int, batch_groups: int,
           stride: int = 1) -> bool:
    """May one more group be admitted at the current version? (`stride`: versions per step)

    Not once this version's batch is complete (`taken_this_version >= batch_groups`): the
    trainer is training it and the next version is near, so a group admitted now would
    carry this version's deadline, one step less of slack than the same group admitted a
    moment later, and a long group near its deadline is what makes the trainer wait. The
    groups already outstanding keep the engines busy through the step; admission reopens
    when the rollout side learns the next version (every training step advances it,
    which is what resets `taken_this_version`). In the simulator at 4 engines this alone
    takes the deadline schedule from 2.35x to 2.54x sync, staleness still <= max_staleness
    (bench/results/async_sim_admission_cpu.txt).
    """
    if taken_this_version >= batch_groups:
        return False
    return outstanding + taken_this_version < (max_staleness // stride + 1) * batch_groups


def plan(items: list[Outstanding[T]], room: int, version: int, batch_groups: int,
         stride: int = 1) -> tuple[list[T], int]:
    """What a collection at `version` with `room` groups still to take should do now.

    Returns (finished groups to take now, in admission order; how many unfinished groups the
    batch must still wait for). `stride` is how many versions one training step advances
    (1 unless a trainer publishes more). Groups past their deadline (only possible after an
    infeasible restore, a change of stride or an engine that fell behind) count as due now.
    """
    order = sorted(items, key=lambda it: it.seq)
    deadlines = sorted({max(it.deadline, version) for it in order})
    chosen: set[int] = set()  # indexes into order
    for d in deadlines:
        upto = [i for i, it in enumerate(order) if max(it.deadline, version) <= d]
        # the later steps up to version d take at most batch_groups each; the rest must go now
        need = len(upto) - ((d - version) // stride) * batch_groups
        have = sum(1 for i in chosen if i in upto)
        # finished ones first (no wait), then the oldest unfinished (a wait)
        for i in sorted(upto, key=lambda i: (order[i].done is None, i)):
            if have >= need:
                break
            if i not in chosen:
                chosen.add(i)
                have += 1
    if len(chosen) > room:  # infeasible: keep the most urgent; the stale check drops the rest later
        chosen = set(sorted(chosen, key=lambda i: (max(order[i].deadline, version), i))[:room])
    for i, it in enumerate(order):  # fill the batch with finished groups, oldest first
        if len(chosen) >= room:
            break
        if it.done is not None:
            chosen.add(i)
    take = [order[i].done for i in sorted(chosen) if order[i].done is not None]
    wait = sum(1 for i in chosen if order[i].done is None)
    return [t for t in take if t is not None], wait
