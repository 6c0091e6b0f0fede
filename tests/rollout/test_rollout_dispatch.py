"""Dispatch: groups on one engine, keys released, dead engines out of the router."""

from __future__ import annotations

import pytest

from miles.rollout.routing.dispatch import Dispatch, NoLiveEngine

pytestmark = pytest.mark.timeout(10)


def test_a_group_key_stays_on_one_engine_and_is_released_with_its_group() -> None:
    d = Dispatch(["e0", "e1"])
    engines = [d.route("g1", 10) for _ in range(8)] + [d.route("g2", 10) for _ in range(8)]
    assert len(set(engines[:8])) == 1 and len(set(engines[8:])) == 1
    assert engines[0] != engines[8]  # the second group goes to the less loaded engine
    d.release("g1")
    d.release("g2")
    assert d.state()["keys_held"] == 0 and d.policy.engine_of("g1") is None
    assert d.counters.groups_routed == 2 and d.counters.groups_split == 0


def test_without_affinity_a_group_splits_and_is_counted() -> None:
    d = Dispatch(["e0", "e1"], affinity=False)
    for _ in range(4):
        d.route("g", 10)
    d.release("g")
    assert d.counters.groups_split == 1


def test_a_down_engine_gets_nothing_and_its_lost_request_does_not_lower_its_load() -> None:
    d = Dispatch(["e0", "e1"])
    e = d.route("g", 100)
    other = "e1" if e == "e0" else "e0"
    assert d.mark_down(e, "killed") and not d.mark_down(e, "again")
    d.lost(e, 100)
    assert d.live == [other] and d.counters.lost_to_down_engine == 1
    assert d.route("g", 100) == other  # the group moved; a forced move is not a split
    d.release("g")
    assert d.counters.groups_split == 0 and d.counters.groups_moved == 1
    assert d.mark_down(other, "killed too")
    with pytest.raises(NoLiveEngine, match="every engine is down"):
        d.route("h", 1)
    assert d.mark_up(e) and not d.mark_up(e)
    assert d.route("h", 1) == e
    # back with no load counted from before its death
    assert d.policy.stats()["engines"][e]["in_flight_tokens"] == 1
