"""Rollout actor: drives the rollout layers against the engines and feeds the bounded buffer.

It holds the session store (token-in-token-out), the router policy and the buffer in
one process: every trajectory the buffer starts runs the configured generate/agent
layers through a session client whose engine calls are routed to engine actors.
The orchestration mode decides when new groups may start:
- `fully_async`: whenever the buffer has a free slot (bounded by capacity/staleness);
- `one_step_off`: at most one batch generated ahead of the trainer;
- `sync`: one batch per weight version, generated only after the trainer's update.

Work the buffer starts while the mode forbids generating is held and generated once
the mode allows (it then samples under the newer weights). A weight update pauses the
engines in `sync.pause_mode`; a request retracted by the pause comes back with its
partial output, and `_engine_call` resubmits prompt + partial output under the new
version, so the sample keeps every token already drawn and its per-token versions
record the mix. A prompt may carry its own `max_new_tokens` and `sampling` overrides
(long-tailed workloads).
On stop the buffer's state (ledger included) is written to `<run.dir>/rollout_state.json`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path
from typing import Any

from miles.actors.evaluator import Evaluator
from miles.actors.messages import DumpState, Generate, GenerateMany, PullBatch, RunEval, SetVersion
from miles.actors.runtime.actor import Actor, handler
from miles.core.errors import KNOWN_ERRORS, ActorDeadError, EngineError, RemoteError
from miles.core.files import atomic_write_text
from miles.core.hooks import resolve_hook
from miles.core.images import ImageInput
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.rollout.buffer import RolloutBuffer, Work
from miles.rollout.client import EngineFn, EngineOutput, LocalSessionClient
from miles.rollout.layers import GenerateContext, default_generate, load_layer, single_turn_agent
from miles.rollout.reward_guard import RewardGuard
from miles.rollout.routing import RouterPolicy
from miles.rollout.session_store import SessionStore
from miles.rollout.tokenizer import Tokenizer
from miles.rollout.types import Group, Sample
from miles.rollout.vl_placeholders import placeholders_from_checkpoint

_DEAD_ENGINE_BACKOFF_S = 0.5
log = get_logger("miles.rollout")

# A request waiting to be sent: (prompt ids, sampling params, the future its reply lands in,
# a VL request's images in wire form or None).
_Queued = tuple[list[int], dict[str, Any], "asyncio.Future[dict[str, Any]]", dict[str, Any] | None]


def _item_error(r: dict[str, Any]) -> Exception:
    """The exception of one failed request of a GenerateMany, as its own ask would raise it."""
    cls = KNOWN_ERRORS.get(r["error_type"])
    if cls is not None and cls is not RemoteError:
        return cls(r["error"])
    return RemoteError(r["error_type"], r["error"], "")


def load_env(cfg: MilesConfig) -> Any:
    make = resolve_hook(cfg.rollout.env, "rollout.env")
    return make(**cfg.rollout.env_args)


class _FrontedClient(LocalSessionClient):
    """In-process session client whose sessions are also reachable over the HTTP front."""

    def __init__(self, store: Any, engine: Any, url: str, token: str = "") -> None:
        super().__init__(store, engine)
        self.url = url
        self.api_key = token  # the front's bearer token: what an OpenAI client sends as its api_key

    def base_url(self, session_id: str) -> str | None:
        return f"{self.url}/sessions/{session_id}/v1"


class RolloutActor(Actor):
    def __init__(self, cfg: MilesConfig, engines: list[str], tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        rc, bc = cfg.rollout, cfg.buffer
        self.env = load_env(cfg)
        self.engines = list(engines)
        self.http: Any = None  # the session HTTP front, when rollout.http_front is on
        self._failures_in_a_row = 0
        self._last_failure = ""
        self.http_url = ""
        self.http_token = ""
        self.tokenizer = tokenizer
        self._eval_hold = False  # shared eval mode: no new generation while the engines evaluate
        self.mode = bc.mode
        self.buffer = RolloutBuffer.from_config(bc, rc.n_samples_per_prompt, prompt_source=self.env.prompts.next)
        if self.mode != "fully_async":
            # sync / one_step_off generate at most one batch ahead: exactly a batch of slots.
            self.buffer.capacity = bc.batch_groups * rc.n_samples_per_prompt
        self.store = SessionStore.from_config(rc, tokenizer)
        self.store.placeholders = placeholders_from_checkpoint(cfg.model.path)  # a VL policy's images
        self.router = RouterPolicy(engines, rc.router_affinity)
        self.agent = load_layer("agent", rc.agent_fn or self.env.agent)
        self.generate = load_layer("generate", rc.generate_fn or "miles.rollout.layers:default_generate")
        self.reward = RewardGuard(resolve_hook(rc.reward_fn, "rollout.reward_fn") if rc.reward_fn else self.env.reward,
                                  rc.reward_errors, rc.reward_max_errors_in_a_row)
        self.sampling: dict[str, Any] = {
            "temperature": rc.temperature, "top_p": rc.top_p, "top_k": max(0, rc.top_k),
            "max_new_tokens": rc.max_new_tokens, "stop_token_ids": tokenizer.stop_token_ids,
        }
        self.version = 0
        self.collected_at = -1  # trainer version at the last collect (sync mode waits for a newer one)
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: list[Work] = []  # work the buffer started that the mode does not let generate yet
        self._released: set[str] = set()  # groups generating in sync / one_step_off (<= one batch)
        self._collecting = 0  # groups of the batch being collected (still count toward the one batch)
        self._batches: dict[int, dict[str, Any]] = {}
        self._pump_task: asyncio.Task[None] | None = None
        self._pull_lock = asyncio.Lock()  # ranks asking for the same step must not collect twice
        self.gen_tokens = 0
        self.gen_samples = 0  # samples of finished trajectories, trained or not (for the length bias)
        self.gen_response_tokens = 0
        self.resubmits = 0  # requests retracted by a weight update and continued under the new version
        self.mixed_version_samples = 0
        self._queued: dict[str, list[_Queued]] = {}  # engine -> requests of this loop iteration

    async def _service_engine(self, key: str, ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        """The HTTP front's engine call: the same routed, retract-aware path as in-process turns."""
        out = await self._engine_call(key, ids, sampling)
        return {"output_ids": out.ids, "logprobs": out.logprobs, "finish_reason": out.finish_reason,
                "versions": out.version, "routed_experts": out.routed_experts, "cached_tokens": 0}

    async def on_start(self) -> None:
        if self.cfg.rollout.http_front:
            from miles.sessions.http import SessionHTTP, read_token
            from miles.sessions.service import SessionService

            service = SessionService(self.store, self._service_engine, sampling=self.sampling)
            self.http_token = read_token(self.cfg.rollout.http_token_file)
            self.http = SessionHTTP(service, self.cfg.transport.interface, self.cfg.rollout.http_port,
                                    token=self.http_token)
            self.http_url = await self.http.start()
            log.info("session_http_front", url=self.http_url)
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-pump")
        self._pump_task.add_done_callback(self._pump_died)

    def _pump_died(self, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            log.error("rollout_pump_failed", error=f"{type(exc).__name__}: {exc}")

    async def on_stop(self) -> None:
        for t in [*self._tasks, *([self._pump_task] if self._pump_task else [])]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.stop()
        path = Path(self.cfg.run.dir) / "rollout_state.json"
        try:
            atomic_write_text(path, json.dumps(self.dump_state(DumpState())))
        except OSError as exc:
            log.warning("rollout_state_not_written", path=str(path), error=str(exc))

    # ------------------------------------------------------------------ generation
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
        if self._eval_hold:
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

    async def _engine_call(self, key: str, prompt_ids: list[int], sampling: dict[str, Any],
                           images: ImageInput | None = None) -> EngineOutput:
        params = {**self.sampling, **sampling}
        budget = int(params["max_new_tokens"])
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            r = await self._generate_once(key, prompt_ids + ids, {**params, "max_new_tokens": budget - len(ids)},
                                          images)
            ids += r["output_ids"]
            logprobs += r["logprobs"]
            versions += r["versions"]
            finish = r["finish_reason"]
            if not r["retracted"]:
                break
            if len(ids) >= budget:
                finish = "length"  # retracted exactly at the budget: nothing left to sample
                break
            # Retracted by a weight update: continue prompt + partial output under the new weights.
            # The routed experts of the continuation cover the whole sequence, so only its are kept.
            self.resubmits += 1
        # [T, L, k] from the embedded engine; [T - 1, L, k] from engines that never feed the last
        # sampled token (SGLang). The trainer accepts both: no loss position needs that row.
        routed = r["routed_experts"]
        if len(set(versions)) > 1:
            self.mixed_version_samples += 1
        self.gen_tokens += len(ids)
        return EngineOutput(ids, logprobs, finish, versions, routed)

    async def _generate_once(self, key: str, input_ids: list[int], sampling: dict[str, Any],
                             images: ImageInput | None = None) -> dict[str, Any]:
        engine = self.router.route(key, len(input_ids))
        cached: int | None = None
        try:
            r = await self._queue_generate(engine, input_ids, sampling, images)
            cached = int(r["cached_tokens"])
        finally:
            self.router.finish(engine, len(input_ids), cached)
        return r

    def _queue_generate(self, engine: str, input_ids: list[int], sampling: dict[str, Any],
                        images: ImageInput | None = None) -> asyncio.Future[dict[str, Any]]:
        """Queue one request for `engine`; the requests queued in one loop iteration go out as
        one message. A group's n trajectories start together and reach here in the same
        iteration, so a group costs one message each way instead of n (~0.1 ms CPU per message
        in each process), and the engine still admits them together."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        queued = self._queued.get(engine)
        if queued is None:
            queued = self._queued[engine] = []
            loop.call_soon(self._send_queued, engine)
        queued.append((input_ids, sampling, fut, None if images is None else images.to_wire()))
        return fut

    def _send_queued(self, engine: str) -> None:
        batch = [q for q in self._queued.pop(engine, []) if not q[2].done()]  # done: its caller is gone
        if batch:
            t = asyncio.create_task(self._ask_engine(engine, batch), name=f"generate-{engine}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _ask_engine(self, engine: str, batch: list[_Queued]) -> None:
        timeout = self.cfg.rollout.generate_timeout_s
        rr = self.cfg.trainer.routing_replay
        try:
            if len(batch) == 1:
                replies = [await self.ref(engine).ask(Generate(batch[0][0], batch[0][1], None, rr, images=batch[0][3]),
                                                      timeout=timeout)]
            else:
                imgs = [q[3] for q in batch] if any(q[3] is not None for q in batch) else []
                replies = await self.ref(engine).ask(
                    GenerateMany([q[0] for q in batch], [q[1] for q in batch], rr, imgs), timeout=timeout)
                if len(replies) != len(batch):
                    raise EngineError(f"{engine}: {len(replies)} replies to {len(batch)} requests")
        except BaseException as exc:
            for _, _, fut, _ in batch:  # every request of the message fails as its own ask would
                if not fut.done():
                    if isinstance(exc, Exception):
                        fut.set_exception(exc)
                    else:
                        fut.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, fut, _), r in zip(batch, replies, strict=True):
            if not fut.done():
                if "error_type" in r:
                    fut.set_exception(_item_error(r))
                else:
                    fut.set_result(r)

    async def _run(self, work: Work) -> None:
        key = f"{work.group_id}/{work.sample_index}"

        async def engine_fn(ids: list[int], sampling: dict[str, Any], images: ImageInput | None = None) -> EngineOutput:
            return await self._engine_call(key, ids, sampling, images)

        client = (LocalSessionClient(self.store, engine_fn) if self.http is None
                  else _FrontedClient(self.store, engine_fn, self.http_url, self.http_token))
        own = dict(work.prompt.get("sampling") or {})  # per-prompt sampling overrides
        if "max_new_tokens" in work.prompt:
            own["max_new_tokens"] = int(work.prompt["max_new_tokens"])
        ctx = GenerateContext(client, work.prompt, self.agent, getattr(self.env, "tools", None), own,
                              work.sample_index, self.cfg.rollout.max_turns)
        try:
            if self.generate is default_generate and self.agent is single_turn_agent and self.http is None:
                samples = await self._one_turn(ctx, engine_fn)
            else:
                samples = await self.generate(ctx)
            self.gen_samples += len(samples)
            self.gen_response_tokens += sum(len(s.response_ids) for s in samples)
            for s in samples:
                if s.status in ("completed", "truncated"):
                    r = self.reward(work.prompt, s)
                    s.reward = float(await r) if inspect.isawaitable(r) else float(r)
            started = self.buffer.finish(work, samples)
            self._failures_in_a_row = 0
        except Exception as exc:  # noqa: BLE001 - any failure is recorded in the buffer, never lost
            log.warning("trajectory_failed", group=work.group_id, sample=work.sample_index,
                        error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ActorDeadError):
                # A dead engine is the supervisor's to restart (or to give up on, which ends the
                # run): not "hopeless generation". Hold the slot a moment so its prompts are not
                # burnt through at the speed of an instant refusal meanwhile.
                await asyncio.sleep(_DEAD_ENGINE_BACKOFF_S)
            else:
                self._failures_in_a_row += 1
            self._last_failure = f"{type(exc).__name__}: {exc}"
            started = self.buffer.fail(work, self._last_failure)
        # The buffer starts new work in the freed slot at once; generate it if the mode allows.
        self._held += started
        self._release()
        self._changed.set()

    async def _one_turn(self, ctx: GenerateContext, engine_fn: EngineFn) -> list[Sample]:
        """What `default_generate` running `single_turn_agent` returns, without a session: a
        session of one turn only records that turn, which cost ~1/3 of the rollout's CPU here.
        The sample is the same (tests/rollout/test_rollout_one_turn.py) less its session_id."""
        turn = self.store.prepare_one(ctx.prompt["messages"], ctx.tools, {"prompt_id": ctx.prompt.get("id")},
                                      ctx.sampling)
        out = await engine_fn(turn.prompt_ids, dict(ctx.sampling), **({} if turn.images is None else
                                                                         {"images": turn.images}))
        sample, message, finish = self.store.commit_one(turn, out.ids, out.logprobs, out.routed_experts,
                                                        out.version, out.finish_reason)
        sample.metadata.update({"response": message.get("content", ""), "finish_reason": finish})
        return [sample]

    # ------------------------------------------------------------------ evaluation (shared mode)
    @handler(RunEval)
    async def run_eval(self, msg: RunEval) -> dict[str, float]:
        """Stop starting new work, let in-flight trajectories finish, evaluate, resume."""
        self._eval_hold = True
        t0 = asyncio.get_running_loop().time()
        try:
            while self._tasks:
                await asyncio.wait(list(self._tasks))
            drained = asyncio.get_running_loop().time() - t0
            m = await Evaluator(self.cfg, self.tokenizer).evaluate(self.host, self.engines)
            m["eval/drain_s"] = drained
            return m
        finally:
            self._eval_hold = False
            self._changed.set()

    # ------------------------------------------------------------------ trainer side
    @handler(SetVersion)
    def set_version(self, msg: SetVersion) -> None:
        self.version = max(self.version, msg.version)
        self.buffer.set_version(self.version)  # later admissions get later deadlines
        self._changed.set()

    @handler(PullBatch, concurrency=16)
    async def pull_batch(self, msg: PullBatch) -> dict[str, Any]:
        # The trainer pulls a version's batch only after announcing that version (SetVersion, a
        # tell): take the version from here too, so a lost announcement cannot stall sync mode.
        self.set_version(SetVersion(msg.trainer_version))
        async with self._pull_lock:
            if msg.step not in self._batches:
                self._batches = {msg.step: await self._collect_batch(msg)}  # same batch for every rank
            return self._batches[msg.step]

    async def _collect_batch(self, msg: PullBatch) -> dict[str, Any]:
        groups: list[Group] = []
        while len(groups) < msg.n_groups:
            self.reward.check()  # a reward function that keeps failing ends the run with its cause
            limit = self.cfg.rollout.max_failures_in_a_row
            if limit and self._failures_in_a_row >= limit:
                # Nothing will ever fill this batch (e.g. every prompt exceeds the engine's length):
                # fail the trainer's request with the cause instead of waiting forever.
                raise EngineError(f"generation failed {self._failures_in_a_row} times in a row with no "
                                  f"success; last error: {self._last_failure}")
            if self.buffer.num_waiting:
                waiting = self.buffer.num_waiting
                got = self.buffer.collect(msg.n_groups - len(groups), msg.trainer_version)
                groups += got
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
        self.collected_at = msg.trainer_version
        self._changed.set()
        metrics = self.buffer.step_metrics(msg.trainer_version)
        samples = [s for g in groups for s in g.samples]
        rewards = [s.reward for s in samples if s.reward is not None]
        trained_tokens = sum(len(s.response_ids) for s in samples)
        metrics.update({
            "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "rollout/response_len_mean": trained_tokens / max(1, len(samples)),
            "rollout/trained_response_tokens": float(trained_tokens),
            "rollout/generated_response_len_mean": self.gen_response_tokens / max(1, self.gen_samples),
            "rollout/generated_samples": float(self.gen_samples),
            "rollout/retracted_resubmits": float(self.resubmits),
            "rollout/mixed_version_samples": float(self.mixed_version_samples),
            "rollout/prefix_hit_rate": float(self.router.prefix_hit_rate),
            "rollout/batch_ready_time": time.time(),
        })
        return {"groups": [g.to_wire() for g in groups], "metrics": metrics}

    @handler(DumpState)
    def dump_state(self, msg: DumpState) -> dict[str, Any]:
        return {"buffer": self.buffer.dump(), "data": self.env.prompts.state()}
