"""Rollout actor: drives the rollout layers against the engines and feeds the bounded buffer.

It holds the session store (token-in-token-out), the router policy and the buffer in
one process: every trajectory the buffer starts runs the configured generate/agent
layers through a session client whose engine calls are routed to engine actors.
The orchestration mode decides when new groups may start:
- `fully_async`: whenever the buffer has a free slot (bounded by capacity/staleness);
- `one_step_off`: at most one batch generated ahead of the trainer;
- `sync`: one batch per weight version, generated only after the trainer's update.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from miles.actors.messages import DumpState, Generate, PullBatch, SetVersion
from miles.actors.runtime.actor import Actor, handler
from miles.core.hooks import resolve_hook
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.rollout.buffer import RolloutBuffer, Work
from miles.rollout.client import EngineOutput, LocalSessionClient
from miles.rollout.layers import GenerateContext, load_layer
from miles.rollout.routing import RouterPolicy
from miles.rollout.session_store import SessionStore
from miles.rollout.tokenizer import Tokenizer
from miles.rollout.types import Group

log = get_logger("miles.rollout")


def load_env(cfg: MilesConfig) -> Any:
    make = resolve_hook(cfg.rollout.env, "rollout.env")
    return make(**cfg.rollout.env_args)


class RolloutActor(Actor):
    def __init__(self, cfg: MilesConfig, engines: list[str], tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        rc, bc = cfg.rollout, cfg.buffer
        self.env = load_env(cfg)
        self.mode = bc.mode
        self.buffer = RolloutBuffer.from_config(bc, rc.n_samples_per_prompt, prompt_source=self.env.prompts.next)
        if self.mode != "fully_async":
            # sync / one_step_off generate at most one batch ahead: exactly a batch of slots.
            self.buffer.capacity = bc.batch_groups * rc.n_samples_per_prompt
        self.store = SessionStore.from_config(rc, tokenizer)
        self.router = RouterPolicy(engines, rc.router_affinity)
        self.agent = load_layer("agent", rc.agent_fn or self.env.agent)
        self.generate = load_layer("generate", rc.generate_fn or "miles.rollout.layers:default_generate")
        self.reward = resolve_hook(rc.reward_fn, "rollout.reward_fn") if rc.reward_fn else self.env.reward
        self.sampling: dict[str, Any] = {
            "temperature": rc.temperature, "top_p": rc.top_p, "top_k": max(0, rc.top_k),
            "max_new_tokens": rc.max_new_tokens, "stop_token_ids": tokenizer.stop_token_ids,
        }
        self.version = 0
        self.collected_at = -1  # trainer version at the last collect (sync mode waits for a newer one)
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: list[Work] = []  # work the buffer started while the mode forbids generating
        self._batches: dict[int, dict[str, Any]] = {}
        self._pump_task: asyncio.Task[None] | None = None
        self.rewards: list[float] = []
        self.gen_tokens = 0

    async def on_start(self) -> None:
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-pump")
        self._pump_task.add_done_callback(self._pump_died)

    def _pump_died(self, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            log.error("rollout_pump_failed", error=f"{type(exc).__name__}: {exc}")

    async def on_stop(self) -> None:
        for t in [*self._tasks, *( [self._pump_task] if self._pump_task else [])]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ generation
    def _may_start(self) -> bool:
        if self.mode == "fully_async":
            return True
        if self.mode == "sync" and self.collected_at >= self.version:
            return False  # the batch for this version is taken: wait for the trainer's update
        return self.buffer.num_waiting + len(self.buffer.groups_in_flight()) < self.cfg.buffer.batch_groups

    async def _pump(self) -> None:
        while True:
            if self._may_start():
                held, self._held = self._held, []
                for w in [*held, *self.buffer.fill()]:
                    self._spawn(w)
            self._changed.clear()
            await self._changed.wait()

    def _spawn(self, work: Work) -> None:
        t = asyncio.create_task(self._run(work), name=f"traj-{work.group_id}-{work.sample_index}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _engine_call(self, key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> EngineOutput:
        engine = self.router.route(key, len(prompt_ids))
        cached: int | None = None
        try:
            r = await self.ref(engine).ask(
                Generate(prompt_ids, {**self.sampling, **sampling}, None, self.cfg.trainer.routing_replay),
                timeout=self.cfg.transport.default_deadline_s * 4,
            )
            cached = int(r["cached_tokens"])
        finally:
            self.router.finish(engine, len(prompt_ids), cached)
        self.gen_tokens += len(r["output_ids"])
        return EngineOutput(r["output_ids"], r["logprobs"], r["finish_reason"], r["versions"],
                            r["routed_experts"])

    async def _run(self, work: Work) -> None:
        key = f"{work.group_id}/{work.sample_index}"

        async def engine_fn(ids: list[int], sampling: dict[str, Any]) -> EngineOutput:
            return await self._engine_call(key, ids, sampling)

        client = LocalSessionClient(self.store, engine_fn)
        ctx = GenerateContext(client, work.prompt, self.agent, getattr(self.env, "tools", None), {},
                              work.sample_index, self.cfg.rollout.max_turns)
        try:
            samples = await self.generate(ctx)
            for s in samples:
                if s.status in ("completed", "truncated"):
                    r = self.reward(work.prompt, s)
                    s.reward = float(await r) if inspect.isawaitable(r) else float(r)
            started = self.buffer.finish(work, samples)
        except Exception as exc:  # noqa: BLE001 - any failure is recorded in the buffer, never lost
            log.warning("trajectory_failed", group=work.group_id, sample=work.sample_index,
                        error=f"{type(exc).__name__}: {exc}")
            started = self.buffer.fail(work, f"{type(exc).__name__}: {exc}")
        # The buffer starts new work in the freed slot at once; generate it.
        if self._may_start():
            for w in started:
                self._spawn(w)
        else:
            self._held.extend(started)
        self._changed.set()

    # ------------------------------------------------------------------ trainer side
    @handler(SetVersion)
    def set_version(self, msg: SetVersion) -> None:
        self.version = max(self.version, msg.version)
        self._changed.set()

    @handler(PullBatch, concurrency=16)
    async def pull_batch(self, msg: PullBatch) -> dict[str, Any]:
        if msg.step in self._batches:
            return self._batches[msg.step]
        groups: list[Group] = []
        while len(groups) < msg.n_groups:
            if self.buffer.num_waiting:
                groups += self.buffer.collect(msg.n_groups - len(groups), msg.trainer_version)
                self.collected_at = msg.trainer_version
                self._changed.set()
                continue
            self._changed.clear()
            await self._changed.wait()
        metrics = self.buffer.step_metrics(msg.trainer_version)
        rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
        metrics["rollout/reward_mean"] = sum(rewards) / len(rewards) if rewards else 0.0
        metrics["rollout/response_len_mean"] = (
            sum(len(s.response_ids) for g in groups for s in g.samples) / max(1, sum(len(g.samples) for g in groups))
        )
        metrics["rollout/prefix_hit_rate"] = float(self.router.prefix_hit_rate)
        out = {"groups": [g.to_wire() for g in groups], "metrics": metrics}
        self._batches = {msg.step: out}  # every rank of this step gets the same batch
        return out

    @handler(DumpState)
    def dump_state(self, msg: DumpState) -> dict[str, Any]:
        return {"buffer": self.buffer.dump(), "data": self.env.prompts.state()}
