"""The bounded buffer: the seed's walkthrough step by step, then a property test."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from miles.rollout.buffer import P, RolloutBuffer, Work
from miles.rollout.filters import dynamic_sampling
from miles.rollout.ledger import Ledger
from miles.rollout.types import Sample


def traj(version: int, reward: float = 1.0, status: str = "completed") -> list[Sample]:
    return [Sample(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2],
                   versions=[version, version], reward=reward, status=status)]  # type: ignore[arg-type]


def prompt(pid: str) -> dict:
    return {"id": pid, "messages": [{"role": "user", "content": pid}]}


def by_name(works: list[Work]) -> dict[str, Work]:
    return {f"{w.prompt_id}{w.sample_index + 1}": w for w in works}


def test_seed_walkthrough() -> None:
    buf = RolloutBuffer(capacity=4, n_samples=2, max_staleness=1, batch_groups=1, schedule="arrival")
    # A' and B' are the prompts that replace A and B (the seed's A1', B1', B2')
    buf.add_prompts([prompt(p) for p in ("C", "A", "B", "A'", "B'")])
    w = by_name(buf.fill())
    assert set(w) == {"C1", "C2", "A1", "A2"} and buf.running == 4
    # C finishes at v3; each freed slot starts a trajectory of B at once
    w |= by_name(buf.finish(w["C1"], traj(3)))
    w |= by_name(buf.finish(w["C2"], traj(3, reward=0.0)))
    assert {"B1", "B2"} <= set(w) and buf.num_waiting == 1 and buf.running == 4
    # A1 finishes (weights v3): its slot is free and A1' starts at once
    started = buf.finish(w["A1"], traj(3))
    assert [(x.prompt_id, x.sample_index) for x in started] == [("A'", 0)]
    w["A'1"] = started[0]
    assert len(buf.groups_in_flight()) == 3 and buf.running == 4  # A, B, A'
    # B finishes both trajectories: both slots start new trajectories at once
    assert len(buf.finish(w["B1"], traj(4))) == 1
    assert len(buf.finish(w["B2"], traj(4, reward=0.0))) == 1
    assert buf.running == 4 and buf.num_waiting == 2
    # the trainer pulls the oldest finished group, C, as a batch of 2 trajectories
    (c,) = buf.collect(1, trainer_version=4)
    assert c.prompt_id == "C" and len(c) == 2
    m = buf.step_metrics(4)
    assert m[P + "queue_size"] == 1 and m[P + "max_staleness"] == 1
    assert m[P + "buffer_max_staleness"] == 0  # B holds v4 tokens
    # later: version 5; A's last trajectory finishes, but A holds a trajectory from v3
    buf.finish(w["A2"], traj(5))
    assert buf.num_waiting == 2  # B, then A
    got = buf.collect(2, trainer_version=5)
    assert [g.prompt_id for g in got] == ["B"]  # 5 - 3 = 2 > 1: A is dropped at collection
    m = buf.step_metrics(5)
    assert m[P + "stale_groups_filtered"] == 1 and m[P + "aborted_groups_filtered"] == 0
    assert m[P + "avg_staleness"] == 1 and m[P + "queue_size"] == 0
    assert buf.ledger.get("A").reasons == ["stale"]
    assert buf.ledger.get("A").state == "pending"  # retried (default policy)
    assert buf.ledger.get("C").state == "trained" and buf.ledger.get("B").trained_version == 5


def test_failure_filter_and_admission_control() -> None:
    buf = RolloutBuffer(capacity=2, n_samples=2, max_staleness=0, retry="discard",
                        filter_fn=dynamic_sampling, admission_control=True, batch_groups=1,
                        schedule="arrival")
    buf.add_prompts([prompt(p) for p in "XYZ"])
    w = buf.fill()
    assert [x.prompt_id for x in w] == ["X", "X"]
    buf.finish(w[0], traj(0))
    more = buf.finish(w[1], traj(0, reward=0.0))
    # X waits; with max_staleness 0 and a batch of 1, admission holds Y back
    assert more == [] and buf.num_waiting == 1
    assert buf.collect(1, 0)[0].prompt_id == "X"
    w = buf.fill()
    assert [x.prompt_id for x in w] == ["Y", "Y"]
    buf.fail(w[0], "engine died")
    w2 = buf.finish(w[1], traj(0))
    assert buf.ledger.get("Y").state == "dropped"  # retry='discard'
    buf.finish(w2[0], traj(0))
    buf.finish(w2[1], traj(0))  # all rewards agree -> zero_std
    m = buf.step_metrics(0)
    assert m["rollout/dynamic_filter/drop_zero_std"] == 1 and m[P + "aborted_groups_filtered"] == 1
    assert buf.ledger.counts() | {} == {"pending": 0, "in_flight": 0, "finished": 0, "trained": 1,
                                        "dropped": 2, "retried": 0, "total": 3}


def test_a_failed_group_drop_says_which_samples_and_why() -> None:
    buf = RolloutBuffer(capacity=4, n_samples=2, batch_groups=1)
    buf.add_prompts([prompt(p) for p in "AB"])
    w = by_name(buf.fill())
    with capture_logs() as logs:
        buf.fail(w["A1"], "EngineError: sampling: non-finite logits")
        buf.finish(w["A2"], traj(0))
        buf.finish(w["B1"], traj(0, status="aborted"))  # cut by its engine: no error text
        buf.finish(w["B2"], traj(0))
    why = [e["why"] for e in logs if e["event"] == "group_dropped_failed"]
    assert why == ["1 of 2 samples failed: EngineError: sampling: non-finite logits", "1 of 2 samples aborted"]
    assert buf.step_metrics(0)[P + "aborted_groups_filtered"] == 2


def test_dump_and_restore() -> None:
    buf = RolloutBuffer(capacity=2, n_samples=1)
    buf.add_prompts([prompt(p) for p in "ABC"])
    a, b = buf.fill()
    buf.finish(a, traj(0))
    d = json.loads(json.dumps(buf.dump()))
    fresh = RolloutBuffer(capacity=2, n_samples=1)
    fresh.load(d)
    assert fresh.ledger.counts()["pending"] == 3  # A was waiting, B running: both start again
    assert [x.prompt_id for x in fresh.fill()] == ["A", "B"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 5), n=st.integers(1, 3), max_staleness=st.integers(0, 2),
    retry=st.sampled_from(["retry", "discard"]), admission=st.booleans(),
    schedule=st.sampled_from(["arrival", "deadline", "budget"]),
    ops=st.lists(st.tuples(st.integers(0, 99), st.sampled_from(["ok", "fail", "same"]),
                           st.integers(0, 3), st.booleans()), max_size=80),
)
def test_no_prompt_lost_or_trained_twice(capacity: int, n: int, max_staleness: int, retry: str,
                                         admission: bool, schedule: str, ops: list) -> None:
    buf = RolloutBuffer(capacity=capacity, n_samples=n, max_staleness=max_staleness, retry=retry,  # type: ignore[arg-type]
                        admission_control=admission, filter_fn=dynamic_sampling, max_attempts=2,
                        schedule=schedule)  # type: ignore[arg-type]
    prompts = [prompt(f"p{i}") for i in range(12)]
    buf.add_prompts(prompts)
    running: list[Work] = buf.fill()
    version, trained, metric_sum = 0, [], {"stale": 0.0, "aborted": 0.0, "zero_std": 0.0}

    def record(m: dict[str, float]) -> None:
        metric_sum["stale"] += m[P + "stale_groups_filtered"]
        metric_sum["aborted"] += m[P + "aborted_groups_filtered"]
        metric_sum["zero_std"] += m.get("rollout/dynamic_filter/drop_zero_std", 0.0)

    for pick, kind, lag, train in ops:
        if running:
            w = running.pop(pick % len(running))
            if kind == "fail":
                running += buf.fail(w, "boom")
            else:
                reward = 1.0 if kind == "same" else float(w.sample_index % 2)
                running += buf.finish(w, traj(max(0, version - lag), reward))
        if train or not running:
            version += 1
            trained += [g.prompt_id for g in buf.collect(1, version)]
            record(buf.step_metrics(version))
            running += buf.fill()
    record(buf.step_metrics(version))
    led = buf.ledger
    counts = led.counts()
    # nothing lost: every prompt is in exactly one state and the states add up
    assert counts["total"] == len(prompts)
    assert sum(counts[s] for s in ("pending", "in_flight", "finished", "trained", "dropped")) == len(prompts)
    assert counts["in_flight"] == len({w.prompt_id for w in running} | {
        g.split("#")[0] for g in buf.groups_in_flight()})
    assert counts["finished"] == buf.num_waiting
    # nothing trained twice, and the ledger agrees on what was trained
    assert len(trained) == len(set(trained)) and sorted(trained) == sorted(led.in_state("trained"))
    # the metrics match the ledger's drop events
    assert metric_sum["stale"] == led.drop_events["stale"]
    assert metric_sum["aborted"] == led.drop_events["failed"]
    assert metric_sum["zero_std"] == led.drop_events["zero_std"] == led.dropped_by_reason["zero_std"]
    # filter-rejected prompts are never retried
    for pid in led.in_state("pending"):
        assert "zero_std" not in led.get(pid).reasons
    # a restored ledger accounts for the same prompts
    restored = Ledger.restore(json.loads(json.dumps(led.dump())))
    assert restored.counts()["total"] == len(prompts)
    assert restored.counts()["trained"] == counts["trained"]


def test_plan_waits_only_for_a_group_due_now() -> None:
    from miles.rollout.schedule import Outstanding, plan

    # batch 2, version 5: A (due 5) still generating, B and C finished with later deadlines
    items = [Outstanding(1, 5, None), Outstanding(2, 6, "B"), Outstanding(3, 7, "C")]
    assert plan(items, 2, 5, 2) == (["B"], 1)  # B fills one place, A must be waited for
    # nothing due before 7: the two oldest finished go, no wait
    items = [Outstanding(1, 7, None), Outstanding(2, 7, "B"), Outstanding(3, 7, "C")]
    assert plan(items, 2, 5, 2) == (["B", "C"], 0)
    # five groups due by 6 and one more step to take them: three must go now, A among them
    items = [Outstanding(i, 6, None if i == 1 else str(i)) for i in range(1, 6)] + [Outstanding(6, 7, "6")]
    assert plan(items, 3, 5, 2) == (["2", "3", "4"], 0)  # finished ones satisfy the count
    assert plan(items[:1] + items[1:3] + [Outstanding(4, 6, None), Outstanding(5, 6, None)], 3, 5, 2) == (
        ["2", "3"], 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 6), n=st.integers(2, 3), max_staleness=st.integers(0, 2), batch=st.integers(1, 3),
    ops=st.lists(st.tuples(st.integers(0, 99), st.sampled_from(["ok", "fail", "same"])), max_size=120),
)
def test_deadline_schedule_never_goes_stale(capacity: int, n: int, max_staleness: int, batch: int,
                                            ops: list) -> None:
    """Any finishing order: every group trained within max_staleness of its oldest token, none
    dropped as stale, every version trains a full batch, and the run never deadlocks."""
    source = iter([prompt(f"p{i}") for i in range(1000)])
    buf = RolloutBuffer(capacity=capacity, n_samples=n, max_staleness=max_staleness, batch_groups=batch,
                        filter_fn=dynamic_sampling, schedule="deadline", max_attempts=2,
                        prompt_source=lambda: next(source, None))
    running: list[tuple[Work, int]] = [(w, 0) for w in buf.fill()]  # (work, version it started at)
    version, current, trained = 0, [], []

    def step(pick: int, kind: str) -> None:
        nonlocal version, current, running
        if running:
            # most picks finish the newest work: the overtaking that makes long groups stale
            w, v0 = running.pop(-1 if pick % 4 else pick % len(running))
            if kind == "fail":
                new = buf.fail(w, "boom")
            else:
                new = buf.finish(w, traj(v0, 1.0 if kind == "same" else float(w.sample_index % 2)))
            running += [(x, version) for x in new]
        current += buf.collect(batch - len(current), version)
        if len(current) == batch:
            for g in current:
                assert version - g.oldest_version() <= max_staleness
            trained.extend(g.prompt_id for g in current)
            m = buf.step_metrics(version)
            assert m[P + "stale_groups_filtered"] == 0 and m[P + "max_staleness"] <= max_staleness
            version, current = version + 1, []
            buf.set_version(version)
        running += [(x, version) for x in buf.fill()]

    for pick, kind in ops:
        step(pick, kind)
    before = len(trained)
    for _ in range(300):  # oldest first, all succeed: what lingered finishes, and progress goes on
        step(0, "ok")
    assert len(trained) >= before + 6 * batch, "the deadline schedule stopped making progress"
    assert len(trained) == len(set(trained))
    assert buf.ledger.drop_events["stale"] == 0
    assert buf.bias.untrained["stale"] == 0


def test_deadline_waits_for_an_overtaken_group() -> None:
    """Newest work always finishes first: p0 is overtaken until it is due, then the trainer waits."""
    buf = RolloutBuffer(capacity=6, n_samples=2, max_staleness=1, batch_groups=1, schedule="deadline",
                        prompt_source=iter([prompt(f"p{i}") for i in range(100)]).__next__)
    running = [(w, 0) for w in buf.fill()]
    version, trained_at = 0, {}
    for i in range(40):
        w, v0 = running.pop(-1 if i < 20 else 0)  # LIFO, then FIFO: p0 finishes late
        running += [(x, version) for x in buf.finish(w, traj(v0, float(w.sample_index % 2)))]
        got = buf.collect(1, version)
        if got:
            trained_at[got[0].prompt_id] = version
            version += 1
            buf.set_version(version)
        running += [(x, version) for x in buf.fill()]
    assert trained_at["p0"] <= 1 and buf.ledger.drop_events["stale"] == 0


def test_arrival_collect_skips_stale_groups_to_fresh_ones() -> None:
    """A full queue of stale groups must not hide a fresh one behind them (the caller would wait
    for a change that, with the queue at max_waiting and nothing generating, never comes)."""
    buf = RolloutBuffer(capacity=3, n_samples=1, max_staleness=0, max_waiting=3, batch_groups=1, schedule="arrival")
    buf.add_prompts([prompt(p) for p in "ABC"])
    a, b, c = buf.fill()
    buf.finish(a, traj(0))
    buf.finish(b, traj(0))
    buf.finish(c, traj(1))
    assert buf.fill() == []  # three wait: no new group
    got = buf.collect(1, trainer_version=1)
    assert [g.prompt_id for g in got] == ["C"] and buf.num_waiting == 0
    assert buf.ledger.drop_events["stale"] == 2
