"""Router policy: affinity, least-loaded placement, engine removal, simulated hit rate."""

from __future__ import annotations

import pytest

from miles.core.errors import EngineError
from miles.rollout.routing.policy import RouterPolicy
from miles.rollout.routing.prefix_cache_sim import simulate_multi_turn
from miles.rollout.tokens.tool_parser import get_tool_parser, split_reasoning


def test_affinity_holds_across_turns_and_new_sessions_go_least_loaded() -> None:
    r = RouterPolicy(["a", "b", "c"])
    assert r.route("s1", 100) == "a"
    assert r.route("s2", 10) == "b"
    assert r.route("s3", 50) == "c"
    assert r.route("s4", 5) == "b"  # b has the fewest in-flight tokens (10)
    r.finish("a", 100, cached_tokens=0)
    for _ in range(3):
        assert r.route("s1", 200) == "a"  # affinity beats load
        r.finish("a", 200, cached_tokens=180)
    assert r.prefix_hit_rate == pytest.approx(540 / 700)
    assert r.stats()["engines"]["a"]["sessions"] == 1


def test_removing_an_engine_reassigns_its_sessions() -> None:
    r = RouterPolicy(["a", "b"])
    r.route("s1", 10)
    r.route("s2", 10)
    r.route("s3", 30)
    assert r.engine_of("s3") == "a"
    moved = r.remove_engine("a")
    assert moved == {"s1": "b", "s3": "b"}
    assert r.route("s1", 1) == "b"
    r.finish("a", 10)  # a late finish from the removed engine is ignored
    with pytest.raises(EngineError, match="unknown engine 'a'"):
        r.remove_engine("a")
    r.remove_engine("b")
    with pytest.raises(EngineError, match="no engine"):
        r.route("s9", 1)
    with pytest.raises(EngineError, match="reported 5 cached of 3"):
        RouterPolicy(["x"]).finish("x", 3, 5)


def test_simulated_prefix_hit_rate_with_and_without_affinity() -> None:
    """SIMULATION of engine prefix caches (rollout/routing/prefix_cache_sim.py), not real engines."""
    with_aff = simulate_multi_turn(engines=4, affinity=True).prefix_hit_rate
    without = simulate_multi_turn(engines=4, affinity=False).prefix_hit_rate
    assert with_aff >= 0.98
    assert without < with_aff - 0.1


def test_json_tags_tool_parser() -> None:
    p = get_tool_parser("json_tags")
    out = p('I will call.<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
            '<tool_call>not json</tool_call>')
    assert out.content == "I will call.<tool_call>not json</tool_call>"
    (c,) = out.tool_calls
    assert c["type"] == "function" and c["id"].startswith("call_")
    assert c["function"] == {"name": "calc", "arguments": '{"expr": "2*3"}'}
    assert p("plain").tool_calls == [] and p("plain").content == "plain"
    assert split_reasoning("<think> a </think> b") == ("a", "b")
    assert split_reasoning("no think") == ("", "no think")
