"""The judge pool's client over a real judge engine process: its answers are the engine's own; a
SIGKILLed judge fails rewards with a counted reason (never a hang, never the run's stop); a
restarted judge is taken back by the health watcher and serves again."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from miles.actors.messages import Generate, Health
from miles.actors.runtime.host import Host
from miles.actors.runtime.messages import DeathNotice
from miles.core.errors import RewardError
from miles.core.schema.reward_model import RewardModelConfig
from miles.engines.base import HealthReply
from miles.rollout.rewards.guard import RewardGuard
from miles.rollout.rewards.judge import JudgeClient, JudgeRefused, JudgeUnavailable, judge_names
from miles.rollout.rewards.judge_rewards import judge_correct, parse_verdict
from miles.rollout.types import Sample

from ..session.session_stack import make_tok, start_host, transport_cfg

pytestmark = pytest.mark.timeout(120)
JUDGE_HOST = "tests/session/procs/session_engine_host.py"
PROMPT = {"id": "p-0", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}


def _judge(host: Host, tok, cfg: RewardModelConfig) -> JudgeClient:
    from miles.actors.engine_link import ActorEngineLink
    from miles.rollout.routing.dispatch import Dispatch
    from miles.rollout.routing.requests import EngineRequests

    reqs = EngineRequests(ActorEngineLink(host.ref, cfg.timeout_s), Dispatch(judge_names(cfg.num_engines), False),
                          {}, live_wait_s=cfg.live_wait_s)

    async def health(engine: str) -> HealthReply:
        reply: HealthReply = await host.ref(engine).ask(Health(), timeout=2.0)
        return reply

    judge = JudgeClient(cfg, reqs, tok, health)

    def on_death(notice: DeathNotice) -> None:
        for name in notice.names:
            if name in reqs.dispatch.known:
                judge.engine_down(name, f"declared dead: {notice.reason}")

    host.on_death(on_death)
    return judge


def _spawn_judge(procs, head: Host, vocab: int):
    return procs.spawn([JUDGE_HOST, "--directory", head.address, "--name", "judge-0", "--vocab", str(vocab)])


def test_parse_verdict() -> None:
    assert parse_verdict("Yes.") == 1.0 and parse_verdict(" no, it is 5") == 0.0
    assert parse_verdict("Correct") == 1.0 and parse_verdict("that is wrong") == 0.0
    assert parse_verdict("maybe") is None and parse_verdict("yesterday") is None


async def test_judge_answers_fail_when_killed_and_recover_on_restart(procs, tmp_path) -> None:
    tok = make_tok(tmp_path)
    head = await start_host()
    rollout_host = Host(transport_cfg(), head.address)
    await rollout_host.start()
    # live_wait_s and the backoff are what each of the 6 calls made while the judge is down waits
    # out (2 attempts: wait, backoff, wait); while it is up, neither is waited on
    cfg = RewardModelConfig(num_engines=1, timeout_s=5.0, retries=1, retry_backoff_s=0.05, live_wait_s=0.2,
                            max_new_tokens=6)
    judge = _judge(rollout_host, tok, cfg)
    try:
        p, _ = await asyncio.to_thread(_spawn_judge, procs, head, tok.vocab_size)
        # the client's answer is the judge engine's own greedy answer
        ids = tok.encode("is 2+2 equal to 4?")
        got, lps = await judge.generate(ids)
        want = await rollout_host.ref("judge-0").ask(
            Generate(ids, {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": tok.stop_token_ids}),
            timeout=30)
        assert got == want.output_ids and lps == want.logprobs
        # a judge-scored reward through the guard: the guard hands the function the client
        guard = RewardGuard(judge_correct, "stop", 3, judge=judge)
        sample = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0], versions=[0],
                        metadata={"response": "4"})
        assert await guard(PROMPT, sample) in (0.0, 1.0)
        assert sum(judge.verdicts.values()) == 1 and judge.ok == 2
        # SIGKILL the judge: every reward fails with a reason, within the deadlines, and the
        # guard (on_error = stop, 3 in a row) does not stop the run for the pool's outage
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        # each fails, never hangs (a hang fails the test's timeout); the seconds a failed call
        # takes are a timing, reported by bench/judge_pool.py's kill run, not asserted here
        for _ in range(5):
            with pytest.raises(RewardError, match="JudgeUnavailable"):
                await guard(PROMPT, sample)
        assert guard.stopped is None and guard.errors["JudgeUnavailable"] == 5
        guard.check()
        m = judge.metrics()
        assert m["reward_model/failed"] == 5 and m["reward_model/calls"] == m["reward_model/ok"] + 5
        assert sum(v for k, v in m.items() if k.startswith("reward_model/failed_")) == 5
        with pytest.raises(JudgeUnavailable):
            await judge.generate(ids)
        # the supervisor's restart: a new judge-0 registers; the watcher takes it back
        await asyncio.to_thread(_spawn_judge, procs, head, tok.vocab_size)
        deadline = time.monotonic() + 30
        while judge.requests.dispatch.live != ["judge-0"]:
            assert time.monotonic() < deadline, judge.requests.dispatch.state()
            await asyncio.sleep(0.1)
        got2, _ = await judge.generate(ids)
        assert got2 == got  # the same frozen weights (the same seed) answer the same
        # a request the judge refuses (over its max_seq_len) fails at once, not retried, as a bug
        retries = judge.retries
        with pytest.raises(JudgeRefused, match="max_seq_len"):
            await judge.generate([1] * 2000)
        assert judge.retries == retries and judge.failed["refused"] == 1
    finally:
        await judge.close()
        await rollout_host.stop()
        await head.stop()
