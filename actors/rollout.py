"""Rollout actor: the shell of the rollout orchestration (rollout/orchestrator.py).

It receives the trainer's messages (SetVersion, PullBatch, RunEval, DumpState), sends
the engine requests the orchestrator batches (Generate / GenerateMany), and tells the
orchestrator which engines are down: the runtime's death notices (a dead engine
process) and failed asks take an engine out of the router; a watcher puts it back once
it answers Health ok again (restarted by the supervisor, or its server back up). With
rollout.http_front the sessions are also reachable over the session HTTP front.
With [reward_model] it also holds the judge pool's client (rollout/rewards/judge.py), whose judges'
death notices it passes on. On stop the buffer's state (ledger included) is written to `<run.dir>/rollout_state.json`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.actors.engine_link import ActorEngineLink
from miles.actors.evaluator import Evaluator
from miles.actors.messages import (
    DumpState,
    Health,
    PullBatch,
    RunEval,
    SetVersion,
    Stats,
)
from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.messages import DeathNotice
from miles.core.errors import MilesError
from miles.core.files import atomic_write_text
from miles.core.hooks import resolve_hook
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.rollout.handout import Handout
from miles.rollout.orchestrator import Orchestrator
from miles.rollout.rewards.judge import JudgeClient, judge_names
from miles.rollout.routing.comeback import UP_POLL_S, serving_again
from miles.rollout.routing.dispatch import Dispatch
from miles.rollout.routing.requests import EngineRequests
from miles.rollout.tito.client import EngineFn, FrontedClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tokenizer import Tokenizer
from miles.rollout.tokens.vl_placeholders import placeholders_from_checkpoint

if TYPE_CHECKING:  # the annotation only: the front's modules load in on_start, with the front
    from miles.engines.base import HealthReply  # (and engines import torch)
    from miles.sessions.service import SessionService

log = get_logger("miles.rollout")
_STATS_TIMEOUT_S = 5.0  # an engine's counters in the final state are a report, not worth a long wait


def load_env(cfg: MilesConfig) -> Any:
    make = resolve_hook(cfg.rollout.env, "rollout.env")
    return make(**cfg.rollout.env_args)


class RolloutActor(Actor):
    def __init__(self, cfg: MilesConfig, engines: list[str], tokenizer: Tokenizer,
                 judge_tokenizer: Tokenizer | None = None) -> None:
        self.cfg, self.engines, self.tokenizer = cfg, list(engines), tokenizer
        rc = cfg.rollout
        self.http: Any = None  # the session HTTP front, when rollout.http_front is on
        self.service: SessionService | None = None  # ... and its session service
        self.http_url = self.http_token = ""
        self.timeout = rc.generate_timeout_s
        store = SessionStore.from_config(rc, tokenizer)
        store.placeholders = placeholders_from_checkpoint(cfg.model.path)  # a VL policy's images
        self.sampling: dict[str, Any] = {**rc.sampling(), "stop_token_ids": tokenizer.stop_token_ids}
        link = ActorEngineLink(self.ref, self.timeout, cfg.trainer.routing_replay)
        self.requests = EngineRequests(link, Dispatch(engines, rc.router_affinity), self.sampling,
                                       live_wait_s=self.timeout, on_down=self._watch_return)
        self.judge = self._judge_client(cfg, judge_tokenizer) if cfg.reward_model.num_engines else None
        self.orch = Orchestrator(cfg, load_env(cfg), store, self.requests,
                                 self._fronted_client if rc.http_front else None, self.judge)
        self.buffer, self.env, self.store = self.orch.buffer, self.orch.env, store
        self.handout = Handout()  # the step's batch, each trainer rank's shard cut from it
        self._pull_lock = asyncio.Lock()  # ranks asking for the same step must not collect twice
        self._watchers: dict[str, asyncio.Task[None]] = {}

    def _judge_client(self, cfg: MilesConfig, tok: Tokenizer | None) -> JudgeClient:
        """The judge pool's client ([reward_model]): its own request path to the judge engines,
        on the same runtime (death notices, health) as the policy's."""
        rm = cfg.reward_model
        link = ActorEngineLink(self.ref, rm.timeout_s)
        reqs = EngineRequests(link, Dispatch(judge_names(rm.num_engines), affinity=False), {},
                              live_wait_s=rm.live_wait_s)

        return JudgeClient(rm, reqs, tok or self.tokenizer, self._health)

    async def _health(self, engine: str) -> HealthReply:
        """`engine`'s Health reply (raises while it is down)."""
        reply: HealthReply = await self.ref(engine).ask(Health(), timeout=max(1.0, UP_POLL_S * 4))
        return reply

    def _fronted_client(self, engine_fn: EngineFn) -> FrontedClient:
        return FrontedClient(self.store, engine_fn, self.http_url, self.http_token,
                             self.service.close if self.service is not None else None,
                             self.requests.end_session if self.cfg.rollout.engine_sessions else None)

    # ------------------------------------------------------------------ engines
    def _on_death(self, notice: DeathNotice) -> None:
        for name in notice.names:
            if name in self.engines:
                self.requests.engine_down(name, f"declared dead: {notice.reason}")
            elif self.judge is not None and name in self.judge.requests.dispatch.known:
                self.judge.engine_down(name, f"declared dead: {notice.reason}")

    def _watch_return(self, engine: str) -> None:
        log.warning("engine_down", engine=engine, why=self.requests.dispatch.down.get(engine, ""),
                    live=self.requests.dispatch.live)
        if engine not in self._watchers or self._watchers[engine].done():
            self._watchers[engine] = asyncio.create_task(self._await_return(engine), name=f"watch-{engine}")

    async def _await_return(self, engine: str) -> None:
        """Ask the down engine for its health until it is ok (restarted, or its server back) at the
        current weight version: a restarted engine serving its start weights until the trainer
        catches it up would only generate groups too stale to train."""
        await serving_again(engine, self._health, lambda: self.orch.version)
        if self.requests.engine_up(engine):
            log.info("engine_up", engine=engine, live=self.requests.dispatch.live)
        self.orch.changed()

    # ------------------------------------------------------------------ life cycle
    def resume_from(self, state: dict[str, Any], where: str) -> None:
        """A stopped run's rollout state (`rollout_state.json` at `where`) before the actor starts."""
        self.orch.load(state, where)

    async def on_start(self) -> None:
        self.host.on_death(self._on_death)
        if self.cfg.rollout.http_front:
            from miles.sessions.http import SessionHTTP, read_token
            from miles.sessions.service import RoutedEngine, SessionService

            engine = RoutedEngine(self.requests)
            self.service = service = SessionService(self.store, engine, engine.end_session, sampling=self.sampling)
            self.http_token = read_token(self.cfg.rollout.http_token_file)
            self.http = SessionHTTP(service, self.cfg.transport.interface, self.cfg.rollout.http_port,
                                    token=self.http_token)
            self.http_url = await self.http.start()
            log.info("session_http_front", url=self.http_url)
        self.orch.start()

    def on_stopping(self) -> None:
        self.orch.halt()  # a PullBatch waiting for a batch gets an answer now, not at the drain's deadline

    async def on_stop(self) -> None:
        for t in self._watchers.values():
            t.cancel()
        await self.orch.stop()
        if self.judge is not None:
            await self.judge.close()
        if self.http is not None:
            await self.http.stop()
        path = Path(self.cfg.run.dir) / "rollout_state.json"
        try:
            atomic_write_text(path, json.dumps(self.orch.dump()))
        except OSError as exc:
            log.warning("rollout_state_not_written", path=str(path), error=str(exc))

    # ------------------------------------------------------------------ trainer side
    @handler(RunEval)
    async def run_eval(self, msg: RunEval) -> dict[str, float]:
        """Stop starting new work, let in-flight trajectories finish, evaluate, resume."""
        try:
            drained = await self.orch.drain()
            m = await Evaluator(self.cfg, self.tokenizer).evaluate(self.host, self.engines, full=msg.full)
            m["eval/drain_s"] = drained
            return m
        finally:
            self.orch.resume()

    @handler(SetVersion)
    def set_version(self, msg: SetVersion) -> None:
        self.orch.set_version(msg.version)

    @handler(PullBatch, concurrency=16)
    async def pull_batch(self, msg: PullBatch) -> dict[str, Any]:
        # The trainer pulls a version's batch only after announcing that version (SetVersion, a
        # tell): take the version from here too, so a lost announcement cannot stall sync mode.
        self.orch.set_version(msg.trainer_version)
        async with self._pull_lock:
            if msg.step != self.handout.step:
                self.handout.set(msg.step, *await self.orch.collect(msg.n_groups, msg.trainer_version))
        return self.handout.shard(msg.dp_rank, msg.dp_size)  # encoded outside the lock: ranks in parallel

    @handler(DumpState, concurrency=4)
    async def dump_state(self, msg: DumpState) -> dict[str, Any]:
        """The buffer's state, and each engine's counters (prompt sharing) as it answers now."""
        engines: dict[str, Any] = {}
        for e in self.engines:
            if e in self.requests.dispatch.down:
                engines[e] = {"down": self.requests.dispatch.down[e]}
                continue
            try:
                engines[e] = await self.ref(e).ask(Stats(), timeout=_STATS_TIMEOUT_S)
            except MilesError as exc:
                engines[e] = {"error": f"{type(exc).__name__}: {exc}"}
        return {**self.orch.dump(), "engines": engines}
