"""Trainer-rank actor: pulls a batch from the rollout buffer, steps, syncs weights, logs metrics.

Each rank runs the same loop; rank 0 also pushes the new weights to the engines,
announces the version to the rollout side and writes metrics.jsonl. Every rank
drains the weight export (it is a collective over FSDP shards).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.actors.engine_yield import EngineYield
from miles.actors.evaluator import Evaluator, run_external
from miles.actors.messages import DumpState, Health, PullBatch, RunEval, SetVersion
from miles.actors.runtime.actor import Actor
from miles.core.clock import Phases
from miles.core.errors import MilesError, Stopping, TrainerError
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.metrics.progress import Progress
from miles.metrics.run_dir import record_trainer
from miles.models.config import ModelSpec
from miles.rollout.handout import shard_from_wire
from miles.trainer.backends import data_parallel, make_trainer
from miles.trainer.batch import TrainBatch, TrainSample, image_token_counts
from miles.weightsync.trainer_side import (
    Publisher,
    make_publisher,
    push_snapshot,
    pushes,
    watch_engines,
)

if TYPE_CHECKING:  # engines import torch; the reply is only read here
    from miles.engines.base import HealthReply

log = get_logger("miles.trainer")


def samples_from_wire(shard: dict[str, Any]) -> TrainBatch:
    """A rank's shard (rollout/handout.py) as a TrainBatch; the arrays are views of the frames."""
    out = [TrainSample(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], reward=s["reward"],
                       group_index=s["group"], loss_mask=s["loss_mask"], rollout_logprobs=s["rollout_logprobs"],
                       routed_experts=s["routed_experts"], versions=s["versions"], temperature=s["temperature"],
                       **_images(s["images"]))
           for s in shard_from_wire(shard)]
    if not out:
        raise TrainerError("the rollout side returned an empty batch")
    return TrainBatch(out)


def _images(images: dict[str, Any] | None) -> dict[str, Any]:
    """A VL sample's images as TrainSample fields ({} without images)."""
    return {} if images is None else {"pixels": images["pixels"], "image_grid": images["grid"]}


class TrainerActor(Actor):
    def __init__(self, cfg: MilesConfig, spec: ModelSpec, rank: int, world: int, engines: list[str],
                 init_checkpoint: str, done: asyncio.Event, sink: Any = None, resume_from: str = "") -> None:
        self.cfg, self.rank, self.world, self.spec = cfg, rank, world, spec
        self.trainer = make_trainer(cfg.trainer, spec, rank, world, init_checkpoint=init_checkpoint,
                                    seed=cfg.run.seed)
        # the trainer section as the backend resolved it for this rank's device (core/schema/runtime.py);
        # rank 0 records it in a launched run's directory
        self.cfg = record_trainer(cfg, self.trainer.cfg, write=rank == 0)
        # ranks of one tensor-parallel group (megatron) train on the same batch shard
        self.dp_size, self.dp_rank = data_parallel(self.trainer, rank, world)
        self.engines = engines
        self.resume_from = resume_from
        self.done = done
        self.sink = sink
        self._progress = Progress(cfg.run.steps)
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        # Rank 0's publisher keeps what a restarted engine is caught up from (the live
        # parameters may be mid-update in a step); made when the loop starts.
        self.publisher: Publisher | None = None
        self.run_dir = Path(cfg.run.dir)
        self._eval_task: asyncio.Task[None] | None = None
        self._eval_done: list[dict[str, Any]] = []
        self.eval_skipped = 0
        self._eval_step = -1  # the last step rank 0 started an evaluation of
        self._evaluator: Evaluator | None = None
        # rank 0 pauses the engines around the train step (trainer.pause_engines); the others compute
        self.yielder = EngineYield(lambda e, m, t: self.ref(e).ask(m, timeout=t), engines,
                                   cfg.trainer.pause_engines and rank == 0, cfg.trainer.pause_timeout_s)

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="trainer-loop")
        self._task.add_done_callback(self._finished)

    def _finished(self, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = self.error = t.exception()  # the process exits 1 either way: it did not reach its end
            if isinstance(exc, Stopping):
                # the rollout answered a batch request while the run stops (Ctrl-C or SIGTERM reach every
                # role at once): the trainer stops with it, which the console must not show as an error
                log.info("trainer_stopped", reason=f"{type(exc).__name__}: {exc}")
            else:
                log.error("trainer_failed", error=f"{type(exc).__name__}: {exc}")
        self.done.set()

    async def on_stop(self) -> None:
        for t in (self._task, self._watch):
            if t is not None and not t.done():
                t.cancel()

    async def _served_version(self, engine: str) -> int:
        """The version `engine` serves now (its health reply); the sync's watcher asks it."""
        h: HealthReply = await self.ref(engine).ask(Health(), timeout=self.cfg.sync.health_timeout_s)
        return h.version

    async def _checkpoint(self, run_dir: Path, step: int) -> None:
        """Trainer state (every rank) + rollout state (rank 0), then an atomic `latest` pointer."""
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        if self.rank == 0:
            # Taken before any rank can pull the next batch, so ledger and weights agree.
            state = await self.ref("rollout").ask(DumpState(), timeout=self.cfg.transport.default_deadline_s)
        await asyncio.to_thread(self.trainer.save_checkpoint, ckpt / "trainer")
        if self.rank == 0:
            _write_json(ckpt / "rollout_state.json", state)
            _write_text(run_dir / "checkpoints" / "latest", ckpt.name)
            log.info("checkpoint_saved", step=step, path=str(ckpt))

    def _export_hf(self, path: Path) -> None:
        """The weights (a collective: every rank calls) plus, from rank 0, the start model's
        tokenizer files and chat template, so the directory loads for chat on its own."""
        from miles.models.hf_companions import copy_companions

        self.trainer.export_hf_checkpoint(path)
        if self.rank == 0:
            copy_companions(self.cfg.model.path, path)

    # ------------------------------------------------------------------ evaluation
    def _maybe_eval(self, step: int, version: int, run_dir: Path) -> None:
        ec = self.cfg.eval
        if ec.mode == "none" or step % ec.every_steps != 0:
            return
        if ec.mode == "external":  # a collective over FSDP shards: every rank exports
            ckpt = run_dir / "eval" / f"step_{step:06d}"
            self._export_hf(ckpt)
        if self.rank != 0:
            return
        if self._eval_task is not None and not self._eval_task.done():
            self.eval_skipped += 1  # the previous evaluation still runs: never queue up behind it
            log.warning("eval_skipped", step=step, reason="previous evaluation still running")
            return
        self._eval_step = step
        self._eval_task = asyncio.create_task(self._run_eval(step, version, run_dir), name="eval")

    async def _eval_at_start(self) -> None:
        """Step 0: the initial weights, evaluated before any training (the 'before' of a run)."""
        if self.cfg.eval.mode == "external":
            self._export_hf(self.run_dir / "eval" / "step_000000")
        if self.rank == 0:
            await self._run_eval(0, self.trainer.weight_version, self.run_dir, full=self.cfg.eval.full_at_ends)

    async def _run_eval(self, step: int, version: int, run_dir: Path, full: bool = False) -> None:
        ec = self.cfg.eval
        t_ready = time.monotonic() - getattr(self, "_t_loop", time.monotonic())
        try:
            if ec.mode == "shared":
                m = await self.ref("rollout").ask(RunEval(step, version, full), timeout=ec.timeout_s)
            elif ec.mode == "snapshot":
                assert self.publisher is not None
                await push_snapshot(self.publisher, self.host, self.cfg, "eval-engine", step)
                if self._evaluator is None:
                    from miles.rollout.tokens.tokenizer import load_tokenizer

                    self._evaluator = Evaluator(self.cfg, load_tokenizer(self.cfg.model.path))
                m = await asyncio.wait_for(self._evaluator.evaluate(self.host, ["eval-engine"], full=full),
                                           ec.timeout_s)
            else:
                m = await run_external(ec.command, str(run_dir / "eval" / f"step_{step:06d}"), step,
                                       ec.timeout_s)
        except (MilesError, TimeoutError, OSError) as exc:
            log.error("eval_failed", step=step, mode=ec.mode, error=f"{type(exc).__name__}: {exc}")
            m = {"eval/failed": 1.0}
        m = {**m, "eval/step": float(step), "eval/version": float(version), "eval/loop_s": t_ready,
             "eval/lag_steps": float(self.trainer.step - step)}
        self._eval_done.append(m)
        with (run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, **m}) + "\n")

    def _eval_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"eval/skipped": float(self.eval_skipped)} if self.cfg.eval.mode != "none" else {}
        if self._eval_done:
            out.update(self._eval_done[-1])
            self._eval_done.clear()
        return out

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        """pull -> train -> hand off the new version -> (offload, eval, checkpoint) -> report."""
        self.publisher = self._make_publisher()
        await self._resume()
        self._t_loop = time.monotonic()  # evaluations record the loop time their weights were ready at
        if self.cfg.eval.at_start and self.cfg.eval.mode != "none" and self.trainer.step == 0:
            await self._eval_at_start()
        limit = self.cfg.run.time_limit_s
        while self.trainer.step < self.cfg.run.steps:
            if limit and time.monotonic() - self._t_loop > limit:
                log.warning("time_limit_reached", step=self.trainer.step, limit_s=limit)
                break
            ph = Phases()
            with ph("wait_rollout"):
                batch, rollout_metrics = await self._pull()
            with ph("train"):
                async with self.yielder.during("train"):
                    metrics = await asyncio.to_thread(self.trainer.train_step, batch)
            version, step = self.trainer.weight_version, self.trainer.step  # train_step made a new version
            await self._check_publishable(step)
            metrics.update(await self._hand_off(version))
            ph.add("sync", metrics.get("perf/sync_s", metrics["perf/export_s"]))
            if self.cfg.trainer.memory.offload_when_idle:
                with ph("offload"):
                    await asyncio.to_thread(self.trainer.offload)
            self._maybe_eval(step, version, self.run_dir)
            with ph("checkpoint"):
                await self._maybe_checkpoint(step)
            self._report(step, version, rollout_metrics, metrics, ph)
        await self._finish()

    def _make_publisher(self) -> Publisher:
        pub = make_publisher(self.cfg, self.spec, self.trainer, self.host, self.engines, self.rank)
        if pushes(pub):  # rank 0 catches up engines that fell behind (e.g. restarted)
            self._watch = asyncio.create_task(
                watch_engines(pub, self._served_version, self.engines, self.cfg.sync.catchup_poll_s),
                name="engine-watch")
        return pub

    async def _resume(self) -> None:
        """Load the checkpoint to resume from, and bring the engines (started from the initial
        weights) to its version."""
        if not self.resume_from:
            return
        await asyncio.to_thread(self.trainer.load_checkpoint, Path(self.resume_from) / "trainer")
        log.info("resumed", step=self.trainer.step, version=self.trainer.weight_version,
                 checkpoint=self.resume_from)
        await self._hand_off(self.trainer.weight_version)

    async def _pull(self) -> tuple[TrainBatch, dict[str, Any]]:
        """This rank's shard of the next batch, and the rollout side's metrics for the step."""
        reply = await self.ref("rollout").ask(
            PullBatch(self.trainer.step, self.trainer.weight_version, self.cfg.buffer.batch_groups,
                      self.dp_rank, self.dp_size),
            timeout=self.cfg.trainer.batch_timeout_s)
        batch = samples_from_wire(reply["shard"])  # this rank's shard only
        if self.spec.vision is not None:  # token exactness of the image placeholders, every step
            v = self.spec.vision
            bad, n = image_token_counts(batch, v.image_token_id, v.spatial_merge_size)
            reply["metrics"].update({"train/image_token_mismatches": bad, "train/image_tokens": n})
            if bad:
                raise TrainerError(f"step {self.trainer.step}: {bad} image token(s) do not line up with their "
                                   "samples' image grids; the engine and the trainer would fill different slots")
        return batch, reply["metrics"]

    async def _check_publishable(self, step: int) -> None:
        """Weights holding a NaN or inf never reach an engine: the run stops here with the reason.
        (A non-finite gradient is already skipped by the step; this catches any other way in.)"""
        bad = await asyncio.to_thread(self.trainer.nonfinite_weights)
        if bad:
            raise TrainerError(f"step {step}: weights {bad} are not finite after the update; they are not "
                               "published to the engines (the logs' nonfinite_grad_skipped lines and "
                               "metrics.jsonl's train/* show what led here)")

    async def _hand_off(self, version: int) -> dict[str, float]:
        """Export (every rank), push and announce (rank 0) a weight version."""
        assert self.publisher is not None
        return await self.publisher.hand_off(version, lambda: self.ref("rollout").tell(SetVersion(version)))

    async def _maybe_checkpoint(self, step: int) -> None:
        every = self.cfg.trainer.checkpoint_interval
        if every and step % every == 0:
            await self._checkpoint(self.run_dir, step)

    def _report(self, step: int, version: int, rollout_metrics: dict[str, Any], metrics: dict[str, float],
                ph: Phases) -> None:
        if self.rank != 0 or self.sink is None:
            return
        rec = {"step": step, "version": version, **rollout_metrics, **metrics, **self._eval_metrics(),
               **ph.metrics()}
        self.sink.write(rec)
        if self.cfg.run.progress:
            print(self._progress.line(rec, time.monotonic()), flush=True)

    async def _finish(self) -> None:
        """Let the last evaluation land, write the ledger (rank 0) and the final HF checkpoint."""
        cfg = self.cfg
        if self._eval_task is not None and not self._eval_task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._eval_task), cfg.eval.timeout_s)
            except TimeoutError:
                log.warning("eval_abandoned_at_end")
        step = self.trainer.step
        on = cfg.eval.at_end and cfg.eval.mode != "none" and step > 0
        # a full evaluation at the end runs even after an every_steps one at the same step (a subset)
        covered = step % cfg.eval.every_steps == 0 and not cfg.eval.full_at_ends
        if on and not covered and cfg.eval.mode == "external":  # a collective: every rank decides alike
            self._export_hf(self.run_dir / "eval" / f"step_{step:06d}")  # (at a covered step: exported)
        # rank 0 also evaluates a covered step whose every_steps evaluation was skipped (the one
        # before it still ran): the run's last weights are always evaluated
        if on and self.rank == 0 and (not covered or self._eval_step != step):
            await self._run_eval(step, self.trainer.weight_version, self.run_dir, full=cfg.eval.full_at_ends)
        if self.rank == 0:
            state = await self.ref("rollout").ask(DumpState(), timeout=cfg.transport.default_deadline_s)
            _write_json(self.run_dir / "ledger.json", state["buffer"]["ledger"])
            _write_json(self.run_dir / "rollout_final.json", state)
        await asyncio.to_thread(self._export_hf, self.run_dir / "final_hf")
        log.info("training_done", steps=self.trainer.step, version=self.trainer.weight_version)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=1))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (the `latest` pointer is written last)."""
    ptr = Path(run_dir) / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    return Path(run_dir) / "checkpoints" / ptr.read_text().strip()
