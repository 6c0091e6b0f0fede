"""TrainSample validation, batch validation, DP sharding and micro-batch packing."""

from __future__ import annotations

import numpy as np
import pytest

from miles.core.errors import TrainerError
from miles.trainer.batch import (
    TrainBatch,
    TrainSample,
    shard_batch,
    split_mini_batches,
    validate_batch,
)
from miles.trainer.packing import filler_micro_batch, pack, plan_micro_batches


def _sample(p: int, r: int, group: int = 0, routes: tuple[int, int] | None = None) -> TrainSample:
    t = p + r
    return TrainSample(
        prompt_ids=np.arange(1, p + 1),
        response_ids=np.arange(100, 100 + r),
        reward=1.0,
        group_index=group,
        rollout_logprobs=np.full(r, -0.5, dtype=np.float32),
        routed_experts=None if routes is None else np.zeros((t - 1, *routes), dtype=np.uint8),
    )


def test_sample_defaults_and_shapes() -> None:
    s = _sample(3, 4)
    assert s.total_len == 7 and s.num_loss_tokens == 4
    assert s.loss_mask is not None and s.loss_mask.dtype == np.float32


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prompt_ids": []}, "empty prompt"),
        ({"response_ids": []}, "empty response"),
        ({"loss_mask": [1, 1]}, "loss_mask"),
        ({"rollout_logprobs": [0.5, -1, -1]}, "<= 0"),
        ({"rollout_logprobs": [-1.0]}, "rollout_logprobs: shape"),
        ({"routed_experts": np.zeros((3, 2, 2), np.uint8)}, "routed_experts: shape"),
        ({"routed_experts": np.zeros((5, 2, 2), np.float32)}, "integer dtype"),
        ({"prompt_ids": [[1, 2]]}, "1-D"),
        ({"reward": float("nan")}, "reward"),
    ],
)
def test_sample_bad_input(kwargs: dict, needle: str) -> None:
    base = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 0.0, "where": "s7"}
    base.update(kwargs)
    with pytest.raises(TrainerError, match=needle):
        TrainSample(**base)


def test_validate_batch_errors() -> None:
    with pytest.raises(TrainerError, match="empty batch"):
        validate_batch(TrainBatch([]), needs_rollout_logprobs=False)
    s = _sample(2, 2)
    s.rollout_logprobs = None
    with pytest.raises(TrainerError, match="no rollout_logprobs"):
        validate_batch(TrainBatch([s]), needs_rollout_logprobs=True)
    validate_batch(TrainBatch([s]), needs_rollout_logprobs=False)
    m = _sample(2, 2, routes=(3, 2))
    with pytest.raises(TrainerError, match="does not match"):
        validate_batch(
            TrainBatch([m]), needs_rollout_logprobs=True, moe_layers=2, topk=2, replay=True
        )
    with pytest.raises(TrainerError, match="no routed_experts"):
        validate_batch(
            TrainBatch([s]), needs_rollout_logprobs=False, moe_layers=2, topk=2, replay=True
        )
    m.routed_experts[0, 0, 0] = 9
    with pytest.raises(TrainerError, match="num_experts"):
        validate_batch(
            TrainBatch([m]),
            needs_rollout_logprobs=True,
            moe_layers=3,
            topk=2,
            num_experts=4,
            replay=True,
        )


def test_plan_micro_batches_ffd() -> None:
    bins = plan_micro_batches([5, 3, 4, 2, 9, 1], budget=8)
    assert sorted(i for b in bins for i in b) == list(range(6))
    lens = [5, 3, 4, 2, 9, 1]
    for b in bins:
        assert sum(lens[i] for i in b) <= 8 or len(b) == 1
    assert bins == [[4], [0, 1], [2, 3, 5]]  # FFD: 9 | 5+3 | 4+2+1
    with pytest.raises(TrainerError):
        plan_micro_batches([1], 0)


def test_pack_positions_and_response_view() -> None:
    samples = [_sample(2, 3, routes=(2, 1)), _sample(3, 1, routes=(2, 1))]
    samples[0].loss_mask = np.array([1, 0, 1], np.float32)
    samples[1].routed_experts[:] = 3
    mb = pack(samples, [0, 1], {"adv": [np.full(3, 2.0), np.full(1, -1.0)]}, replay=True)
    assert mb.input_ids.tolist() == [1, 2, 100, 101, 102, 1, 2, 3, 100]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 5, 9]
    assert mb.resp_pos.tolist() == [1, 2, 3, 7]
    assert mb.input_ids[mb.resp_pos + 1].tolist() == mb.resp_targets.tolist()
    assert mb.resp_seq.tolist() == [0, 0, 0, 1]
    assert mb.loss_mask.tolist() == [1, 0, 1, 1]
    assert mb.fields["adv"].tolist() == [2, 2, 2, -1]
    assert mb.routed_experts is not None and mb.routed_experts.shape == (9, 2, 1)
    assert mb.routed_experts[5:].unique().tolist() == [3]
    f = filler_micro_batch(["adv"])
    assert f.num_tokens == 1 and f.resp_pos.numel() == 0 and f.fields["adv"].numel() == 0


def test_shard_keeps_groups_and_balances() -> None:
    samples = [_sample(4, 4, group=g) for g in range(3) for _ in range(2)]
    samples += [_sample(10, 10, group=3)]
    shards = shard_batch(TrainBatch(samples, weight_version=5), 2)
    assert sum(len(s) for s in shards) == len(samples)
    for sh in shards:
        assert sh.weight_version == 5
    groups = [{s.group_index for s in sh.samples} for sh in shards]
    assert not (groups[0] & groups[1])
    assert abs(shards[0].num_tokens - shards[1].num_tokens) <= 16
    with pytest.raises(TrainerError, match="groups cannot feed"):
        shard_batch(TrainBatch(samples[:2]), 2)


def test_split_mini_batches() -> None:
    samples = [_sample(2, 2, group=g) for g in (0, 1, 0, 2, 1, 3)]
    parts = split_mini_batches(samples, 2)
    assert [[s.group_index for s in p] for p in parts] == [[0, 0, 1, 1], [2, 3]]
    with pytest.raises(TrainerError):
        split_mini_batches(samples, 5)
