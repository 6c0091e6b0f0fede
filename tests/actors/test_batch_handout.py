"""The batch hand-out: each trainer rank decodes only its shard, and gets what it kept before.

Before, every rank pulled the whole batch (one dict per sample, token ids as lists), built
every TrainSample and kept `shard_batch(...)[rank]`. Now the rollout cuts the shard
(rollout/handout.py) and the rank decodes only that, its per-token arrays as frames. The
samples must be equal, field by field, over the real codec; routed experts (R3) and
samples without them; the arrays are views of the received frames (no copy).
"""

from __future__ import annotations

import numpy as np
import pytest

from miles.actors.trainer import samples_from_wire
from miles.core.errors import TrainerError
from miles.rollout.handout import Handout, assign
from miles.rollout.types import Group, Sample
from miles.trainer.batch import TrainBatch, TrainSample, shard_batch
from miles.transport import codec

pytestmark = pytest.mark.timeout(60)


def _batch(n_groups: int, n: int, routed: bool, seed: int = 0) -> list[Group]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        p = int(rng.integers(3, 40))
        prompt = rng.integers(0, 1000, p).tolist()
        samples = []
        for i in range(n):
            r = int(rng.integers(1, 30))
            mask = rng.integers(0, 2, r)
            samples.append(Sample(
                prompt_ids=prompt, response_ids=rng.integers(0, 1000, r).tolist(),
                loss_mask=mask.tolist(), rollout_logprobs=(-rng.random(r) * mask).tolist(),
                versions=rng.integers(0, 3, r).tolist(),
                routed_experts=rng.integers(0, 8, (p + r, 2, 2)).astype(np.uint8) if routed else None,
                reward=float(rng.random()), index=i))
        groups.append(Group(f"p{g}", samples, g))
    return groups


def _old_rank_view(groups: list[Group], rank: int, world: int) -> TrainBatch:
    """What a rank trained on before: the whole batch's TrainSamples, then its shard."""
    full = TrainBatch([TrainSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, reward=s.reward or 0.0,
                                   group_index=gi, loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
                                   routed_experts=s.routed_experts, versions=s.versions)
                       for gi, g in enumerate(groups) for s in g.samples])
    return shard_batch(full, world)[rank] if world > 1 else full


def _over_the_wire(reply: dict) -> dict:
    frames = codec.encode(codec.REPLY, 1, "trainer-0", reply)
    return codec.decode([bytes(f) if i == 0 else np.asarray(f).tobytes() for i, f in enumerate(frames)]).body


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("routed", [True, False])
def test_each_rank_gets_the_shard_it_kept_before(world: int, routed: bool) -> None:
    groups = _batch(9, 4, routed, seed=world)
    h = Handout()
    h.set(5, groups, {"rollout/reward_mean": 0.5})
    seen: set[int] = set()
    for rank in range(world):
        reply = _over_the_wire(h.shard(rank, world))
        assert reply["metrics"] == {"rollout/reward_mean": 0.5}
        got, want = samples_from_wire(reply["shard"]).samples, _old_rank_view(groups, rank, world).samples
        assert len(got) == len(want) > 0
        for a, b in zip(got, want, strict=True):
            assert a.group_index == b.group_index and a.reward == b.reward
            for f in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "versions", "routed_experts"):
                x, y = getattr(a, f), getattr(b, f)
                assert (x is None) == (y is None), f
                if x is not None:
                    assert x.dtype == y.dtype and np.array_equal(x, y), f
        seen |= {s.group_index for s in got}
    assert seen == set(range(9))  # every group on exactly one rank (the shards are disjoint by assign)


def test_the_ranks_arrays_are_views_of_the_frames() -> None:
    groups = _batch(4, 8, routed=True)
    h = Handout()
    h.set(0, groups, {})
    shard = _over_the_wire(h.shard(0, 2))["shard"]
    batch = samples_from_wire(shard)
    for s in batch.samples:
        assert np.shares_memory(s.response_ids, shard["response_ids"])
        assert np.shares_memory(s.rollout_logprobs, shard["rollout_logprobs"])
        assert np.shares_memory(s.routed_experts, shard["routed"])


def test_mixed_routed_experts_travel_per_sample_and_a_bad_world_is_refused() -> None:
    groups = _batch(2, 2, routed=True)
    groups[1].samples[0].routed_experts = None  # e.g. a sample from an engine without R3
    h = Handout()
    h.set(0, groups, {})
    got = samples_from_wire(_over_the_wire(h.shard(0, 1))["shard"]).samples
    assert got[2].routed_experts is None and got[3].routed_experts is not None
    with pytest.raises(TrainerError, match="3 groups cannot feed 4 ranks|2 groups cannot feed 4 ranks"):
        assign(groups, 4)
    with pytest.raises(TrainerError, match="rank 2 is not in a world of 2"):
        h.shard(2, 2)
