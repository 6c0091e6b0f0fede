"""The reward functions' way to the judge engine pool: a client with deadlines, retries and metrics.

The judge engines (`[reward_model]`, role `judge_engine`, actors `judge-0`, ...) are ordinary
engine actors serving a frozen model: the trainer never sends them weights. This client
reaches them through the rollout's own request path (`EngineRequests` + `Dispatch`: routing,
batching, a dead engine taken out and its request sent to another), so a judge is supervised
like a policy engine: the runtime's death notice takes it out (`engine_down`), the supervisor
restarts it, and a watcher puts it back once it answers `Health` ok.

Each call has a deadline per attempt (`timeout_s`) and `retries` more attempts with a
backoff; a call that still fails raises `JudgeUnavailable` with the reason (no live judge,
timeout, engine error). A request the judge refuses (too long for reward_model.max_seq_len)
raises `JudgeRefused` at once: retrying cannot help, and the guard treats it as a bug. The reward guard counts it and drops the sample with that reason; it
never ends the run (rollout/rewards/guard.py), so a judge that is down costs rewards, counted,
and never hangs the run. `metrics()` reports `reward_model/*` per training step.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Protocol

from miles.core.errors import BadRequest, EngineError, MilesError
from miles.core.logging import get_logger
from miles.core.schema.reward_model import RewardModelConfig
from miles.rollout.routing.comeback import HealthCall, serving_again
from miles.rollout.routing.requests import EngineRequests
from miles.rollout.tokens.tokenizer import Tokenizer

log = get_logger("miles.judge")


class JudgeUnavailable(EngineError):
    """A judge call failed after its retries (the reason names why); the reward is not computed."""


class JudgeRefused(EngineError):
    """The judge engine refused the request itself (e.g. a prompt over reward_model.max_seq_len):
    not an outage, so not retried, and it counts toward the reward guard's stop like a bug."""


def judge_names(n: int) -> list[str]:
    return [f"judge-{i}" for i in range(n)]


class Judge(Protocol):
    """What a reward function gets as its `judge` argument."""

    tok: Tokenizer

    async def chat(self, messages: list[dict[str, Any]], max_new_tokens: int | None = None) -> str: ...

    async def generate(self, ids: list[int], max_new_tokens: int | None = None) -> tuple[list[int], list[float]]: ...

    def count_verdict(self, verdict: str) -> None: ...


class JudgeClient:
    """Greedy generation on the judge pool, for reward functions (see the module doc)."""

    def __init__(self, cfg: RewardModelConfig, requests: EngineRequests, tokenizer: Tokenizer,
                 health: HealthCall | None = None) -> None:
        self.cfg, self.requests, self.tok = cfg, requests, tokenizer
        self.health = health
        self.requests.on_down = self._watch_return
        self.calls = self.ok = self.retries = 0
        self.failed: Counter[str] = Counter()  # reason -> calls that failed after their retries
        self.seconds = 0.0  # wall time of finished calls, summed (calls overlap: this is judge load)
        self.tokens = 0
        self.verdicts: Counter[str] = Counter()  # parsed answers, as the reward functions report them
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._n = 0

    # ------------------------------------------------------------------ calls
    async def generate(self, ids: list[int], max_new_tokens: int | None = None) -> tuple[list[int], list[float]]:
        """The judge's greedy answer to `ids`: (answer ids, their logprobs)."""
        self.calls += 1
        self._n += 1
        key = f"judge-call-{self._n}"  # no session to keep together: any live judge serves it
        sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens or self.cfg.max_new_tokens,
                    "stop_token_ids": list(self.tok.stop_token_ids)}
        t0 = time.monotonic()
        backoff = self.cfg.retry_backoff_s
        last = ""
        try:
            for attempt in range(self.cfg.retries + 1):
                if attempt:
                    self.retries += 1
                    await asyncio.sleep(backoff)
                    backoff *= 2
                try:
                    out = await asyncio.wait_for(self.requests.call(key, ids, sampling), self.cfg.timeout_s)
                except TimeoutError:
                    last = f"timeout: no answer in reward_model.timeout_s={self.cfg.timeout_s:g}s"
                except BadRequest as exc:  # the same request fails the same way on every try
                    self.failed["refused"] += 1
                    raise JudgeRefused(f"the judge refused the request: {exc} (see [reward_model])") from exc
                except MilesError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    self.ok += 1
                    self.tokens += len(out.ids)
                    return out.ids, out.logprobs
                finally:
                    await self.requests.release(key)
            reason = _reason(last)
            self.failed[reason] += 1
            raise JudgeUnavailable(f"judge call failed after {self.cfg.retries + 1} attempts ({reason}): {last}")
        finally:
            self.seconds += time.monotonic() - t0

    async def chat(self, messages: list[dict[str, Any]], max_new_tokens: int | None = None) -> str:
        """The judge's greedy reply to a chat, as text (its template, generation prompt on)."""
        ids = self.tok.encode(self.tok.apply_chat_template(messages, None, True))
        out, _ = await self.generate(ids, max_new_tokens)
        stops = set(self.tok.stop_token_ids)
        return self.tok.decode([t for t in out if t not in stops])

    def count_verdict(self, verdict: str) -> None:
        """A reward function's parse of an answer (yes / no / unparsed), for the metrics."""
        self.verdicts[verdict] += 1

    # ------------------------------------------------------------------ supervision
    def engine_down(self, engine: str, why: str) -> None:
        """A death notice named a judge: take it out of the routing until it is back."""
        self.requests.engine_down(engine, why)

    def _watch_return(self, engine: str) -> None:
        log.warning("judge_down", engine=engine, why=self.requests.dispatch.down.get(engine, ""),
                    live=self.requests.dispatch.live)
        if self.health is not None and (engine not in self._watchers or self._watchers[engine].done()):
            self._watchers[engine] = asyncio.create_task(self._await_return(engine), name=f"watch-{engine}")

    async def _await_return(self, engine: str) -> None:
        assert self.health is not None
        await serving_again(engine, self.health)  # frozen weights: any version it serves is the judge's
        if self.requests.engine_up(engine):
            log.info("judge_up", engine=engine, live=self.requests.dispatch.live)

    async def close(self) -> None:
        for t in self._watchers.values():
            t.cancel()
        await self.requests.close()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """Totals since the start (a step's share is the difference of two steps' values)."""
        failed = sum(self.failed.values())
        m = {"reward_model/calls": float(self.calls), "reward_model/ok": float(self.ok),
             "reward_model/failed": float(failed), "reward_model/retries": float(self.retries),
             "reward_model/time_s": self.seconds, "reward_model/answer_tokens": float(self.tokens),
             "reward_model/mean_call_s": self.seconds / max(1, self.ok + failed),
             "reward_model/live_engines": float(len(self.requests.dispatch.live))}
        for reason, n in self.failed.items():
            m[f"reward_model/failed_{reason}"] = float(n)
        for verdict, n in self.verdicts.items():
            m[f"reward_model/verdict_{verdict}"] = float(n)
        return m


def _reason(error: str) -> str:
    """A short reason tag for the metrics: timeout | no_live_judge | engine_down | engine_error
    (and `refused`, counted where it is raised)."""
    if error.startswith("timeout"):
        return "timeout"
    if "no live engine" in error:
        return "no_live_judge"
    if error.startswith(("ActorDeadError", "PeerGone", "EngineDown", "PeerTimeout")):
        return "engine_down"
    return "engine_error"
