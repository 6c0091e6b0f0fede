"""A black-box agent (the OpenAI client) in a real run, through the rollout process's HTTP front;
and a run whose generation can never succeed stops with the cause instead of hanging."""

from __future__ import annotations

from pathlib import Path

import pytest

from .e2e_helpers import check_ledger, metrics, start_run, wait

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
AGENT = ["--set", "rollout.env=miles.rollout.envs.openai_agent:make_env", "--set", "rollout.http_front=true",
         "--set", "rollout.max_turns=2", "--set", "run.warmup_sft_steps=0"]


def test_openai_client_agent_trains(tmp_path: Path, miles_cache: Path) -> None:
    run = tmp_path / "run"
    # Under CURVE with the launcher's key set: every role authenticates to every other.
    p = start_run(run, miles_cache, *AGENT, "--set", "run.steps=2", "--set", "engine.max_seq_len=1024",
                  "--set", "rollout.max_new_tokens=16", "--set", "buffer.batch_groups=2",
                  "--set", "rollout.n_samples_per_prompt=2", "--set", "transport.curve=true")
    assert wait(p, 280) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert check_ledger(run)["buffer"]["ledger"]["entries"]
    # every turn went over the front with its session key; each trajectory's session, closed by the
    # generate layer before its group could be collected, ended on its engine (its KV freed)
    assert rows[0]["rollout/engine_sessions_ended"] >= 2 * 2 and rows[-1]["rollout/end_session_failures"] == 0
    secrets = list((run / "keys").rglob("*.key_secret"))
    assert secrets and all(s.stat().st_mode & 0o077 == 0 for s in secrets)
    # the HTTP front was authenticated too: the agent's OpenAI client sent the launcher's token
    token = run / "keys" / "http_token"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) >= 16


def test_hopeless_generation_stops_with_the_cause(tmp_path: Path, miles_cache: Path) -> None:
    run = tmp_path / "run"
    # The tool env's prompts render to ~366 tokens, far more than a 64-token context (pinned here,
    # not inherited from the quick start's config): every request is refused by the engine.
    p = start_run(run, miles_cache, *AGENT, "--set", "run.steps=2", "--set", "engine.max_seq_len=64",
                  "--set", "rollout.max_failures_in_a_row=32")
    assert wait(p, 280) != 0
    log = (tmp_path / "run.launcher.log").read_text()
    assert metrics(run) == [], "a step trained although no prompt fits the context"
    # The run ends with the cause, not with a false death of a busy process (the flake seen before:
    # heartbeats stalled behind the rollout's loop and the trainer died of ActorDeadError).
    assert "trainer_exited" in log and "leaves no room under max_seq_len" in log, log[-3000:]
    assert "ActorDeadError" not in log
