"""Sample/Group wire round trips and validation errors."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from miles.core.errors import ProtocolError
from miles.rollout.types import Group, Sample


def _sample(index: int = 0, status: str = "completed") -> Sample:
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6],
        loss_mask=[1, 0, 1],
        rollout_logprobs=[-0.5, 0.0, -0.25],
        versions=[3, -1, 4],
        routed_experts=np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2),
        reward=1.0,
        status=status,  # type: ignore[arg-type]
        index=index,
        metadata={"k": "v"},
    )


def test_sample_round_trip_through_msgpack() -> None:
    g = Group(prompt_id="p0", samples=[_sample(0), _sample(1, "truncated")], prompt_index=7)
    raw = msgpack.packb(g.to_wire(arrays_as_bytes=True))
    back = Group.from_wire(msgpack.unpackb(raw))
    assert back.prompt_id == "p0" and back.prompt_index == 7
    s = back.samples[1]
    assert s.response_ids == [4, 5, 6] and s.status == "truncated" and s.index == 1
    assert s.routed_experts is not None
    np.testing.assert_array_equal(s.routed_experts, g.samples[1].routed_experts)
    assert back.oldest_version() == 3
    assert s.ids == [1, 2, 3, 4, 5, 6]


def test_group_failed_and_rewards() -> None:
    g = Group(prompt_id="p", samples=[_sample(0), _sample(1, "aborted")])
    assert g.failed() and g.rewards == [1.0, 1.0]
    assert not Group(prompt_id="p", samples=[_sample()]).failed()


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"loss_mask": [1, 0]}, "loss_mask: length 2"),
        ({"loss_mask": [1, 2, 1]}, "loss_mask[1]"),
        ({"rollout_logprobs": [-0.5, -1.0, -0.2]}, "must be 0 where loss_mask is 0"),
        ({"status": "weird"}, "status"),
        ({"prompt_ids": "abc"}, "prompt_ids"),
        ({"response_ids": [4, "x", 6]}, "response_ids[1]"),
        ({"bogus": 1}, "unknown fields"),
        ({"reward": "high"}, "reward"),
    ],
)
def test_sample_from_wire_names_bad_field(patch: dict, needle: str) -> None:
    d = _sample().to_wire()
    d.update(patch)
    with pytest.raises(ProtocolError, match=None) as ei:
        Sample.from_wire(d, "g.samples[0]")
    assert needle in str(ei.value) and "g.samples[0]" in str(ei.value)


def test_routed_experts_shape_checked() -> None:
    with pytest.raises(ProtocolError, match="routed_experts"):
        Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.1],
               versions=[0], routed_experts=np.zeros((3, 1, 1), np.uint8))
    with pytest.raises(ProtocolError, match="uint8/uint16"):
        Sample(prompt_ids=[1], response_ids=[], routed_experts=np.zeros((1, 1, 1), np.int64))
