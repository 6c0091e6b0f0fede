"""The rollout orchestration: when groups generate, how each trajectory runs, what a batch is.

One plain class, driven by the rollout actor (actors/rollout.py, a shell) and by tests
without sockets. It holds the bounded buffer, the session store, the reward guard and
the engine requests (rollout/routing/requests.py: routing by group, batching, retract/resubmit,
dead engines). The orchestration mode decides when new groups may start:
- `fully_async`: whenever the buffer has a free slot (bounded by capacity/staleness);
- `one_step_off`: at most one batch generated ahead of the trainer;
- `sync`: one batch per weight version, generated only after the trainer's update.
Work the buffer starts while the mode forbids generating is held and generated once
the mode allows (it then samples under the newer weights). A prompt may carry its own
`max_new_tokens` and `sampling` overrides (long-tailed workloads). Every trajectory of a
group uses the group id as its routing key, released when the group ends.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from miles.core.errors import ActorDeadError, EngineError, StartupError, Stopping
from miles.core.hooks import resolve_hook
from miles.core.images import ImageInput
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.rollout.buffer import RolloutBuffer, Work
from miles.rollout.layers import GenerateContext, default_generate, load_layer, single_turn_agent
from miles.rollout.rewards.guard import RewardGuard
from miles.rollout.rewards.judge import JudgeClient, JudgeUnavailable
from miles.rollout.routing.requests import EngineRequests
from miles.rollout.tito.client import EngineFn, EngineOutput, LocalSessionClient, SessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.types import Group, Sample

_DEAD_ENGINE_BACKOFF_S = 0.5
log = get_logger("miles.rollout")

# engine function of one trajectory -> the session client its layers talk to
ClientFactory = Callable[[EngineFn], SessionClient]


class Orchestrator:
    def __init__(self, cfg: MilesConfig, env: Any, store: SessionStore, requests: EngineRequests,
                 make_client: ClientFactory | None = None, judge: JudgeClient | None = None) -> None:
        self.cfg, self.env, self.store, self.requests = cfg, env, store, requests
        self.judge = judge  # the judge pool's client ([reward_model]), handed to reward functions that ask
        rc, bc = cfg.rollout, cfg.buffer
        self.mode = bc.mode
        self.buffer = RolloutBuffer.from_config(bc, rc.n_samples_per_prompt, prompt_source=env.prompts.next)
        self.agent = load_layer("agent", rc.agent_fn or env.agent)
        self.generate = load_layer("generate", rc.generate_fn or "miles.rollout.layers:default_generate")
        self.reward = RewardGuard(resolve_hook(rc.reward_fn, "rollout.reward_fn") if rc.reward_fn else env.reward,
                                  rc.reward_errors, rc.reward_max_errors_in_a_row, judge)
        # A multi-turn trajectory's engine keeps its KV between turns (rollout.engine_sessions).
        end = requests.end_session if rc.engine_sessions else None
        self.make_client = make_client or (lambda fn: LocalSessionClient(store, fn, end))
        # The default single-turn layers need no session: `_one_turn` gives the same sample
        # (tests/rollout/test_rollout_one_turn.py) for ~1/3 less rollout CPU. Not when the
        # sessions must be reachable over the HTTP front.
        self.one_turn = (self.generate is default_generate and self.agent is single_turn_agent
                         and make_client is None)
        self.version = 0
        self.collected_at = -1  # trainer version at the last collect (sync mode waits for a newer one)
        self.eval_hold = False  # shared eval mode: no new generation while the engines evaluate
        self._changed = asyncio.Event()
        self.halted = False  # the process is stopping: no batch will be completed any more
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: list[Work] = []  # work the buffer started that the mode does not let generate yet
        self._released: set[str] = set()  # groups generating in sync / one_step_off (<= one batch)
        self._collecting = 0  # groups of the batch being collected (still count toward the one batch)
        self._pump_task: asyncio.Task[None] | None = None
        self.resumed_after: int | None = None  # a resumed run's last trained version (start())
        self.failures_in_a_row = 0
        self.last_failure = ""
        self.gen_samples = 0  # samples of finished trajectories, trained or not (for the length bias)
        self.gen_response_tokens = 0
        self._judge_last: dict[str, float] = {}  # the judge's totals at the last collect

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        # A resumed run (the buffer restored from a checkpoint) generates nothing until the trainer
        # announces a version newer than any it trained: until its hand-off the engines hold their
        # start weights, and what they sampled would only be dropped as stale.
        self.resumed_after = self.buffer.ledger.last_trained_version()
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-pump")
        self._pump_task.add_done_callback(_pump_died)

    async def stop(self) -> None:
        await self.requests.close()
        tasks = [*self._tasks, *([self._pump_task] if self._pump_task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def halt(self) -> None:
        """The process is stopping: a collect that waits ends now with `Stopping`, as does any later one."""
        self.halted = True
        self._changed.set()

    def changed(self) -> None:
        """Something admission depends on changed (a version, an engine back): look again."""
        self._changed.set()

    # ------------------------------------------------------------------ admission
    def _may_open_group(self) -> bool:
        """May a group that has not generated yet begin now (before the per-batch bound)?"""
        if self.mode == "sync":
            return self.collected_at < self.version  # this version's batch is taken: wait for the update
        return True

    def _release(self) -> None:
        """Generate the held work the mode allows now.

        fully_async generates all of it. sync / one_step_off let at most one batch of groups be
        generating or waiting: a group's work is released with its first trajectory, so every
        trajectory of a group samples under the weights the group started with (or newer).
        """
        if self.eval_hold or (self.resumed_after is not None and self.version <= self.resumed_after):
            return
        if self.mode == "fully_async":
            held, self._held = self._held, []
            for w in held:
                self._spawn(w)
            return
        self._released &= set(self.buffer.groups_in_flight())  # arrived groups now count as waiting
        active = self.buffer.num_waiting + len(self._released) + self._collecting
        keep: list[Work] = []
        for w in self._held:
            if w.group_id not in self._released:
                if not (self._may_open_group() and active < self.cfg.buffer.batch_groups):
                    keep.append(w)
                    continue
                self._released.add(w.group_id)
                active += 1
            self._spawn(w)
        self._held = keep

    async def _pump(self) -> None:
        while True:
            self._held += self.buffer.fill()
            self._release()
            self._changed.clear()
            await self._changed.wait()

    def _spawn(self, work: Work) -> None:
        t = asyncio.create_task(self._run(work), name=f"traj-{work.group_id}-{work.sample_index}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one trajectory
    async def _run(self, work: Work) -> None:
        key = work.group_id  # the whole group on one engine: its prompt is prefilled once

        async def engine_fn(ids: list[int], sampling: dict[str, Any], images: ImageInput | None = None,
                            session: str | None = None) -> EngineOutput:
            return await self.requests.call(key, ids, sampling, images, session)

        own = dict(work.prompt.get("sampling") or {})  # per-prompt sampling overrides
        if "max_new_tokens" in work.prompt:
            own["max_new_tokens"] = int(work.prompt["max_new_tokens"])
        ctx = GenerateContext(self.make_client(engine_fn), work.prompt, self.agent, getattr(self.env, "tools", None),
                              own, work.sample_index, self.cfg.rollout.max_turns)
        try:
            samples = await (self._one_turn(ctx, engine_fn) if self.one_turn else self.generate(ctx))
            self.gen_samples += len(samples)
            self.gen_response_tokens += sum(len(s.response_ids) for s in samples)
            for s in samples:
                if s.status in ("completed", "truncated"):
                    r = self.reward(work.prompt, s)
                    s.reward = float(await r) if inspect.isawaitable(r) else float(r)
            started = self.buffer.finish(work, samples)
            self.failures_in_a_row = 0
        except Exception as exc:  # noqa: BLE001 - any failure is recorded in the buffer, never lost
            log.warning("trajectory_failed", group=work.group_id, sample=work.sample_index,
                        error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ActorDeadError) or isinstance(exc.__cause__, JudgeUnavailable):
                # No engine (or judge) came back in time: the supervisor's to restart (or to give
                # up on, which ends the run), not "hopeless generation". Hold the slot a moment so
                # its prompts are not burnt through at the speed of an instant refusal meanwhile.
                await asyncio.sleep(_DEAD_ENGINE_BACKOFF_S)
            else:
                self.failures_in_a_row += 1
            self.last_failure = f"{type(exc).__name__}: {exc}"
            started = self.buffer.fail(work, self.last_failure)
        if not self.buffer.group_open(work.group_id):
            await self.requests.release(key)  # and ends the engine sessions still open under it
        # The buffer starts new work in the freed slot at once; generate it if the mode allows.
        self._held += started
        self._release()
        self._changed.set()

    async def _one_turn(self, ctx: GenerateContext, engine_fn: EngineFn) -> list[Sample]:
        """What `default_generate` running `single_turn_agent` returns, without a session: a
        session of one turn only records that turn. The sample is the same less its session_id."""
        turn = self.store.prepare_one(ctx.prompt["messages"], ctx.tools, {"prompt_id": ctx.prompt.get("id")},
                                      ctx.sampling)
        out = await engine_fn(turn.prompt_ids, dict(ctx.sampling), **({} if turn.images is None else
                                                                         {"images": turn.images}))
        sample, message, finish = self.store.commit_one(turn, out.ids, out.logprobs, out.routed_experts,
                                                        out.version, out.finish_reason)
        sample.metadata.update({"response": message.get("content", ""), "finish_reason": finish})
        return [sample]

    # ------------------------------------------------------------------ evaluation (shared mode)
    async def drain(self) -> float:
        """Start no new work and wait for the trajectories in flight; returns the seconds waited."""
        self.eval_hold = True
        t0 = time.monotonic()
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        return time.monotonic() - t0

    def resume(self) -> None:
        self.eval_hold = False
        self._changed.set()

    # ------------------------------------------------------------------ trainer side
    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)
        self.buffer.set_version(self.version)  # later admissions get later deadlines
        self._changed.set()

    async def collect(self, n_groups: int, trainer_version: int) -> tuple[list[Group], dict[str, float]]:
        """The next batch of `n_groups` for `trainer_version`, and the rollout's step metrics."""
        groups: list[Group] = []
        while len(groups) < n_groups:
            if self.halted:
                raise Stopping(f"the rollout is stopping: the batch for trainer version {trainer_version} "
                               f"ends with {len(groups)} of {n_groups} groups")
            self.reward.check()  # a reward function that keeps failing ends the run with its cause
            limit = self.cfg.rollout.max_failures_in_a_row
            if limit and self.failures_in_a_row >= limit:
                # Nothing will ever fill this batch (e.g. every prompt exceeds the engine's length):
                # fail the trainer's request with the cause instead of waiting forever.
                raise EngineError(f"generation failed {self.failures_in_a_row} times in a row with no "
                                  f"success; last error: {self.last_failure}")
            if self.buffer.num_waiting:
                waiting = self.buffer.num_waiting
                groups += self.buffer.collect(n_groups - len(groups), trainer_version)
                self._collecting = len(groups)
                if self.buffer.num_waiting != waiting:
                    self._changed.set()  # slots below max_waiting / admission bound may have opened
                    continue  # something was taken or dropped: look again before waiting
                # nothing to take yet: the deadline schedule waits for a group due at this version
            self._changed.clear()
            await self._changed.wait()
        self._collecting = 0
        # Only a complete batch closes this version's generation in sync mode: a group still
        # missing (e.g. a retry after a failure) must be allowed to generate.
        self.collected_at = trainer_version
        self._changed.set()
        return groups, self._metrics(groups, trainer_version)

    def _metrics(self, groups: list[Group], trainer_version: int) -> dict[str, float]:
        m = self.buffer.step_metrics(trainer_version)
        samples = [s for g in groups for s in g.samples]
        rewards = [s.reward for s in samples if s.reward is not None]
        trained_tokens = sum(len(s.response_ids) for s in samples)
        rq = self.requests
        m.update({
            "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "rollout/response_len_mean": trained_tokens / max(1, len(samples)),
            "rollout/trained_response_tokens": float(trained_tokens),
            "rollout/generated_response_len_mean": self.gen_response_tokens / max(1, self.gen_samples),
            "rollout/generated_samples": float(self.gen_samples),
            "rollout/retracted_resubmits": float(rq.resubmits),
            "rollout/mixed_version_samples": float(rq.mixed_version_samples),
            # sessions whose engines keep their KV between turns, and the EndSessions that freed it
            "rollout/engine_sessions_open": float(len(rq.sessions)),
            "rollout/engine_sessions_ended": float(rq.sessions_ended),
            "rollout/end_session_failures": float(rq.end_session_failures),
            **rq.dispatch.metrics(),
            "rollout/batch_ready_time": time.time(),
        })
        for kind, n in self.reward.errors.items():  # failed rewards by type (their samples were dropped)
            m[f"rollout/reward_failed_{kind}"] = float(n)
        if self.judge is not None:
            m.update(self._judge_metrics())
        return m

    def _judge_metrics(self) -> dict[str, float]:
        """The judge's totals, and this step's share of its calls and time (the step breakdown's
        `reward_model/step_time_s`: judge seconds spent on this batch's window, overlapping generation)."""
        assert self.judge is not None
        now = self.judge.metrics()
        last, self._judge_last = self._judge_last, now
        for k in ("calls", "failed", "time_s"):
            now[f"reward_model/step_{k}"] = now[f"reward_model/{k}"] - last.get(f"reward_model/{k}", 0.0)
        return now

    def dump(self) -> dict[str, Any]:
        return {"buffer": self.buffer.dump(), "data": self.env.prompts.state(),
                "routing": self.requests.dispatch.state()}

    def load(self, state: dict[str, Any], where: str = "rollout state") -> None:
        """Resume from a `dump()`: in-flight and finished-but-untrained prompts become pending
        again, and the prompt stream goes on where it was. The routing part is a record of the
        run, not restored: the engines of a resumed run hold no session KV."""
        missing = [k for k in ("buffer", "data") if k not in state]
        if missing:
            raise StartupError(f"{where}: missing {missing} (not written by a stopped run's rollout)")
        self.buffer.load(state["buffer"])
        self.env.prompts.load_state(state["data"])


def _pump_died(t: asyncio.Task[None]) -> None:
    if not t.cancelled() and t.exception() is not None:
        exc = t.exception()
        log.error("rollout_pump_failed", error=f"{type(exc).__name__}: {exc}")
