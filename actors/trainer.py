"""Trainer-rank actor: pulls a batch from the rollout buffer, steps, syncs weights, logs metrics.

Each rank runs the same loop; rank 0 also pushes the new weights to the engines,
announces the version to the rollout side and writes metrics.jsonl. Every rank
drains the weight export (it is a collective over FSDP shards).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from miles.actors.evaluator import Evaluator, run_external
from miles.actors.messages import DumpState, Health, PullBatch, RunEval, SetVersion
from miles.actors.runtime.actor import Actor
from miles.actors.sync import WeightSync
from miles.core.errors import MilesError, TrainerError
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.models.config import ModelSpec
from miles.trainer.backends import check_lora_launch, data_parallel, make_trainer
from miles.trainer.batch import TrainBatch, TrainSample, shard_batch
from miles.transport.bulk.flat import FlatWeights

log = get_logger("miles.trainer")


def samples_from_wire(groups: list[dict[str, Any]]) -> TrainBatch:
    out: list[TrainSample] = []
    for gi, g in enumerate(groups):
        for s in g["samples"]:
            out.append(TrainSample(
                prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], reward=float(s["reward"] or 0.0),
                group_index=gi, loss_mask=s["loss_mask"], rollout_logprobs=s["rollout_logprobs"],
                routed_experts=s.get("routed_experts"), versions=s["versions"],
            ))
    if not out:
        raise TrainerError("the rollout side returned an empty batch")
    return TrainBatch(out)


class TrainerActor(Actor):
    def __init__(self, cfg: MilesConfig, spec: ModelSpec, rank: int, world: int, engines: list[str],
                 init_checkpoint: str, done: asyncio.Event, sink: Any = None, resume_from: str = "") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        check_lora_launch(cfg)
        self.trainer = make_trainer(cfg.trainer, spec, rank, world, init_checkpoint=init_checkpoint,
                                    seed=cfg.run.seed, asynchronous=cfg.buffer.mode != "sync")
        # ranks of one tensor-parallel group (megatron) train on the same batch shard
        self.dp_size, self.dp_rank = data_parallel(self.trainer, rank, world)
        self.engines = engines
        self.resume_from = resume_from
        self.done = done
        self.sink = sink
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        # Rank 0 keeps a host copy of the last pushed version: a restarted engine is caught up
        # from it while training goes on (the live parameters may be mid-update in a step).
        self._last_pushed: tuple[int, dict[str, Any]] | None = None
        self._sync_lock = asyncio.Lock()
        self._eval_task: asyncio.Task[None] | None = None
        self._eval_done: list[dict[str, Any]] = []
        self.eval_skipped = 0
        self._evaluator: Evaluator | None = None
        self.pushed_bytes = 0  # bytes of the last version handed to the sync (adapters only with LoRA)

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="trainer-loop")
        self._task.add_done_callback(self._finished)

    def _finished(self, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            self.error = t.exception()
            log.error("trainer_failed", error=f"{type(self.error).__name__}: {self.error}")
        self.done.set()

    async def on_stop(self) -> None:
        for t in (self._task, self._watch):
            if t is not None and not t.done():
                t.cancel()

    def _export(self) -> Any:
        """What this rank's trainer hands the sync: flat (one persistent buffer, byte ranges)
        when `sync.flat_export` says so, else tensor by tensor."""
        sc = self.cfg.sync  # (a LoRA trainer exports its adapters tensor by tensor either way)
        return self.trainer.export_sync_state(flat=sc.flat, dtype=None if sc.dtype == "same" else getattr(torch, sc.dtype))

    async def _push(self, sync: WeightSync, version: int, state: Any) -> Any:
        """Push a version to every engine, keeping a host copy for catch-ups."""
        copy: dict[str, Any] = {}

        def keep() -> Any:
            for name, t in state:
                copy[name] = t.detach().to("cpu", copy=True)
                yield name, t

        if isinstance(state, FlatWeights):  # a flat export: one host copy, and it goes out as byte ranges
            copy.update(FlatWeights(state.buffer.to("cpu", copy=True), state.plan))
            pushed: Any = state
        else:
            pushed = keep()
        async with self._sync_lock:
            rep = await sync.push(version, pushed)
        self._last_pushed = (version, copy)
        self.pushed_bytes = sum(t.numel() * t.element_size() for t in copy.values())
        return rep

    async def _watch_engines(self, sync: WeightSync) -> None:
        """Catch up any engine that serves an older version than the last push (e.g. restarted)."""
        while True:
            await asyncio.sleep(1.0)
            if self._last_pushed is None:
                continue
            version, state = self._last_pushed
            for name in self.engines:
                try:
                    h = await self.ref(name).ask(Health(), timeout=5)
                except MilesError:
                    continue  # dead or restarting: try again next round
                if int(h.get("version", 0)) >= version:
                    continue
                async with self._sync_lock:
                    if self._last_pushed[0] != version:
                        break  # a newer push happened meanwhile; re-check next round
                    try:
                        await sync.catch_up(name, version, state.items())
                        log.warning("engine_caught_up", engine=name, version=version)
                    except MilesError as exc:
                        log.warning("engine_catch_up_failed", engine=name, error=str(exc))

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

    # ------------------------------------------------------------------ evaluation
    def _maybe_eval(self, step: int, version: int, run_dir: Path) -> None:
        ec = self.cfg.eval
        if ec.mode == "none" or step % ec.every_steps != 0:
            return
        if ec.mode == "external":  # a collective over FSDP shards: every rank exports
            ckpt = run_dir / "eval" / f"step_{step:06d}"
            self.trainer.export_hf_checkpoint(ckpt)
        if self.rank != 0:
            return
        if self._eval_task is not None and not self._eval_task.done():
            self.eval_skipped += 1  # the previous evaluation still runs: never queue up behind it
            log.warning("eval_skipped", step=step, reason="previous evaluation still running")
            return
        self._eval_task = asyncio.create_task(self._run_eval(step, version, run_dir), name="eval")

    async def _run_eval(self, step: int, version: int, run_dir: Path) -> None:
        ec = self.cfg.eval
        try:
            if ec.mode == "shared":
                m = await self.ref("rollout").ask(RunEval(step, version), timeout=ec.timeout_s)
            elif ec.mode == "snapshot":
                assert self._last_pushed is not None
                _, state = self._last_pushed
                snap = WeightSync(self.host, dataclasses.replace(self.cfg.sync, transport="zmq",
                                                                 pause_mode="none"), ["eval-engine"])
                await snap.push(version, state.items())
                if self._evaluator is None:
                    from miles.rollout.tokenizer import load_tokenizer

                    self._evaluator = Evaluator(self.cfg, load_tokenizer(self.cfg.model.path))
                m = await asyncio.wait_for(self._evaluator.evaluate(self.host, ["eval-engine"]), ec.timeout_s)
            else:
                m = await run_external(ec.command, str(run_dir / "eval" / f"step_{step:06d}"), step,
                                       ec.timeout_s)
        except (MilesError, TimeoutError, OSError) as exc:
            log.error("eval_failed", step=step, mode=ec.mode, error=f"{type(exc).__name__}: {exc}")
            m = {"eval/failed": 1.0}
        m = {**m, "eval/step": float(step), "eval/version": float(version),
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

    async def _loop(self) -> None:
        cfg = self.cfg
        rollout = self.ref("rollout")
        sync = WeightSync(self.host, cfg.sync, self.engines, self.trainer.device) if self.rank == 0 else None
        if sync is not None:
            self._watch = asyncio.create_task(self._watch_engines(sync), name="engine-watch")
        run_dir = Path(cfg.run.dir)
        if self.resume_from:
            await asyncio.to_thread(self.trainer.load_checkpoint, Path(self.resume_from) / "trainer")
            log.info("resumed", step=self.trainer.step, version=self.trainer.weight_version,
                     checkpoint=self.resume_from)
            # Engines restart from the initial weights: bring them to the checkpoint's version.
            state = self._export()
            if sync is not None:
                await self._push(sync, self.trainer.weight_version, state)
                await rollout.tell(SetVersion(self.trainer.weight_version))
            else:
                for _ in state:
                    pass
        while self.trainer.step < cfg.run.steps:
            t0 = time.perf_counter()
            version = self.trainer.weight_version
            reply = await rollout.ask(PullBatch(self.trainer.step, version, cfg.buffer.batch_groups),
                                      timeout=cfg.sync.step_timeout_s * 10)
            t_wait = time.perf_counter() - t0
            batch = samples_from_wire(reply["groups"])
            shard = shard_batch(batch, self.dp_size)[self.dp_rank] if self.dp_size > 1 else batch
            metrics = await asyncio.to_thread(self.trainer.train_step, shard)
            new_version = version + 1
            self.trainer.weight_version = new_version
            t_sync = time.perf_counter()
            state = self._export()
            if sync is not None:
                rep = await self._push(sync, new_version, state)
                await rollout.tell(SetVersion(new_version))
                metrics.update({"sync/seconds": rep.seconds, "sync/gbps": rep.gbps,
                                "sync/dead_engines": float(len(rep.dead)), "sync/bytes": float(rep.bytes),
                                "sync/payload_bytes": float(self.pushed_bytes)})
            else:
                for _ in state:  # every rank drains the gather collective
                    pass
            if cfg.trainer.memory.offload_when_idle:
                metrics["perf/offload_s"] = await asyncio.to_thread(self.trainer.offload)
            step = self.trainer.step
            self._maybe_eval(step, new_version, run_dir)
            if self.rank == 0 and self.sink is not None:
                rec = {"step": step, "version": new_version, **reply["metrics"], **metrics,
                       **self._eval_metrics(),
                       "perf/step_time_s": time.perf_counter() - t0, "perf/wait_rollout_s": t_wait,
                       "perf/sync_s": time.perf_counter() - t_sync}
                self.sink.write(rec)
                if cfg.run.progress:
                    print(
                        f"step {step:4d} | reward {rec.get('rollout/reward_mean', 0):.3f} | "
                        f"staleness {rec.get('rollout/fully_async/avg_staleness', 0):.2f} | "
                        f"Δlogp {rec.get('train/train_rollout_logprob_abs_diff', 0):.4f} | "
                        f"tok/s {rec.get('train/tokens_per_s', 0):.0f} | step {rec['perf/step_time_s']:.2f}s",
                        flush=True,
                    )
            if cfg.trainer.checkpoint_interval and step % cfg.trainer.checkpoint_interval == 0:
                await self._checkpoint(run_dir, step)
        if self._eval_task is not None and not self._eval_task.done():
            try:  # let the last evaluation land in eval.jsonl
                await asyncio.wait_for(asyncio.shield(self._eval_task), cfg.eval.timeout_s)
            except TimeoutError:
                log.warning("eval_abandoned_at_end")
        if self.rank == 0:
            state = await rollout.ask(DumpState(), timeout=cfg.transport.default_deadline_s)
            _write_json(run_dir / "ledger.json", state["buffer"]["ledger"])
            _write_json(run_dir / "rollout_final.json", state)
        await asyncio.to_thread(self.trainer.export_hf_checkpoint, run_dir / "final_hf")
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
