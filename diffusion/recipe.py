"""The diffusion RL loop: engine actor + weight sync + the LLM recipe's buffer and ledger.

Everything runs in one process, with the real parts: the engine is a `DiffusionEngineActor`
on an actor host (its own directory, loopback ZeroMQ), weights go trainer -> engine through
`actors/sync.py`'s `WeightSync` on the configured bulk transport (pause, buckets, atomic
commit, optional checksum check), and prompts flow through `rollout/buffer.py`'s
`RolloutBuffer`, whose `Ledger` accounts for every prompt (a prompt here is a condition and a
noise seed; its group is `n_samples` trajectories). The trainer and the engine's forward
passes run in worker threads so generation and training overlap.

Modes: `fully_async` - generation never waits for training; a finished trajectory's slot
starts new work at once, staleness is checked when groups are collected. `sync` (and every
deterministic run) - generate a batch, train on it, push the weights, repeat.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.actors.runtime.process import dump_tasks
from miles.actors.sync import WeightSync
from miles.core.config import dump_json
from miles.core.errors import ConfigError, EngineError
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig
from miles.diffusion.actor import Denoise, DiffusionEngineActor
from miles.diffusion.config import DiffusionConfig
from miles.diffusion.data import NULL_CLASS, SHAPES
from miles.diffusion.engine import DiffusionEngine
from miles.diffusion.model import FlowUNet, FlowUNetSpec, load_weights, save_weights
from miles.diffusion.precision import apply_precision, dtype_of
from miles.diffusion.pretrain import PretrainPlan, pretrain
from miles.diffusion.rewards import RewardFn, load_reward
from miles.diffusion.sampler import SDESchedule
from miles.diffusion.trainer import DiffusionBatch, DiffusionTrainer
from miles.metrics.sink import MetricsSink
from miles.rollout.buffer import RolloutBuffer, Work
from miles.rollout.types import Group, Sample
from miles.trainer.deterministic import request_seed

log = get_logger("miles.diffusion.recipe")
ENGINE = "diffusion-engine-0"
EVAL_SEED = 10_000_000


@dataclass
class RecipeResult:
    run_dir: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    eval_rewards: list[tuple[int, float]] = field(default_factory=list)
    ledger: dict[str, int] = field(default_factory=dict)
    final_state: dict[str, torch.Tensor] = field(default_factory=dict)
    first_images: np.ndarray | None = None
    last_images: np.ndarray | None = None
    seconds: float = 0.0
    pretrain_seconds: float = 0.0


def spec_of(cfg: DiffusionConfig) -> FlowUNetSpec:
    m = cfg.model
    return FlowUNetSpec(channels=m.channels, emb_dim=m.emb_dim, image_size=m.image_size)


def base_model(cfg: DiffusionConfig, run_dir: Path) -> tuple[FlowUNet, float]:
    """The starting policy (FP32): loaded, or pretrained here and saved beside the run."""
    if cfg.model.checkpoint:
        return load_weights(cfg.model.checkpoint, spec_of(cfg)), 0.0
    t0 = time.perf_counter()
    plan = PretrainPlan(steps=cfg.model.pretrain_steps, batch=cfg.model.pretrain_batch, seed=cfg.run.seed,
                        time_budget_s=cfg.model.pretrain_seconds)
    model, losses = pretrain(spec_of(cfg), plan)
    save_weights(model, run_dir / "base.safetensors")
    (run_dir / "pretrain_loss.json").write_text(json.dumps(losses))
    return model, time.perf_counter() - t0


def condition_id(cfg: DiffusionConfig) -> int:
    c = cfg.sampler.condition
    return NULL_CLASS if c == "any" else SHAPES.index(c)


class DiffusionRecipe:
    """One run. `await run()` returns the curve, the ledger and the final weights."""

    def __init__(self, cfg: DiffusionConfig) -> None:
        if cfg.buffer.mode == "one_step_off":
            raise ConfigError("buffer.mode='one_step_off' is not offered by the diffusion recipe; "
                              "use 'sync' or 'fully_async' (bounded by buffer.max_staleness)")
        self.cfg = cfg
        self.lockstep = cfg.buffer.mode == "sync" or cfg.precision.deterministic
        self.dir = Path(cfg.run.dir)
        self.sched = SDESchedule(cfg.sampler.steps, cfg.sampler.noise_level)
        self.cond = condition_id(cfg)
        self._prompt_seq = 0
        self._changed = asyncio.Event()
        self._deferred: list[Work] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self.failed: list[str] = []
        self._crash: BaseException | None = None

    # ---------------------------------------------------------------- prompts and generation
    def _next_prompt(self) -> dict[str, Any]:
        k = self._prompt_seq
        self._prompt_seq += 1
        return {"id": f"p{k}", "index": k, "condition": self.cond}

    def _seed(self, w: Work) -> int:
        return request_seed(self.cfg.run.seed, w.prompt_id, w.attempt, w.sample_index)

    async def _denoise(self, conds: list[int], seeds: list[int], ids: list[str]) -> list[dict[str, Any]]:
        return await self.host.ref(ENGINE).ask(Denoise(conds, seeds, ids), timeout=600)

    def _dispatch(self, works: list[Work]) -> None:
        if not works:
            return
        if self.lockstep:
            self._deferred.extend(works)
            return
        task = asyncio.ensure_future(self._generate(works))
        self._inflight.add(task)
        task.add_done_callback(self._generation_done)

    def _generation_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # a bug here would leave the trainer waiting for groups that never come: stop the run
            self._crash = task.exception()
            log.error("generation_task_crashed", error=repr(self._crash))
            self._changed.set()

    async def _generate(self, works: list[Work]) -> None:
        ids = [f"{w.group_id}/{w.sample_index}" for w in works]
        try:
            res = await self._denoise([int(w.prompt["condition"]) for w in works], [self._seed(w) for w in works], ids)
        except Exception as exc:  # noqa: BLE001 - counted as failed trajectories, retried by the buffer
            log.error("denoise_request_failed", error=str(exc), trajectories=len(works))
            self.failed.append(str(exc))
            new: list[Work] = []
            for w in works:
                new += self.buffer.fail(w, str(exc))
            self._changed.set()
            self._dispatch(new)
            return
        self.failed = []  # the limit below counts consecutive failures
        images = torch.from_numpy(np.stack([r["latents"][-1] for r in res]))
        rewards = await asyncio.to_thread(self.reward, images, torch.tensor([r["condition"] for r in res]))
        new = []
        for w, r, rew in zip(works, res, rewards.tolist(), strict=True):
            steps = len(r["logprobs"])
            s = Sample(prompt_ids=[int(r["condition"])], response_ids=list(range(steps)), loss_mask=[1] * steps,
                       rollout_logprobs=[float(x) for x in r["logprobs"]], versions=[int(v) for v in r["versions"]],
                       reward=float(rew), status="aborted" if r["aborted"] else "completed", index=w.sample_index,
                       metadata={"latents": r["latents"], "seed": int(r["seed"])})
            new += self.buffer.finish(w, [s])
        self._changed.set()
        self._dispatch(new)

    # ---------------------------------------------------------------- training
    def _batch(self, groups: list[Group]) -> DiffusionBatch:
        samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples]
        return DiffusionBatch(
            latents=torch.from_numpy(np.stack([s.metadata["latents"] for _, s in samples])),
            rollout_logp=torch.tensor([s.rollout_logprobs for _, s in samples], dtype=torch.float32),
            versions=torch.tensor([s.versions for _, s in samples], dtype=torch.long),
            conditions=torch.tensor([s.prompt_ids[0] for _, s in samples], dtype=torch.long),
            rewards=torch.tensor([float(s.reward or 0.0) for _, s in samples], dtype=torch.float32),
            groups=torch.tensor([gi for gi, _ in samples], dtype=torch.long))

    async def _collect(self) -> list[Group]:
        want = self.cfg.buffer.batch_groups
        got: list[Group] = []
        while True:
            self._changed.clear()
            if self._crash is not None:
                raise self._crash
            got += self.buffer.collect(want - len(got), self.trainer.weight_version)
            self._dispatch(self.buffer.fill())  # collection freed waiting room
            if len(got) >= want:
                return got
            if self.failed and len(self.failed) > 10 * want:
                raise EngineError(f"diffusion recipe: {len(self.failed)} generation requests failed in a row; "
                                  f"last: {self.failed[-1]}")
            if self.lockstep:
                if not self._deferred:
                    raise ConfigError(f"diffusion recipe (lock-step): the buffer starts no work but {want} groups "
                                      f"are wanted and {len(got)} collected; is buffer.capacity >= "
                                      "buffer.batch_groups * n_samples?")
                works, self._deferred = self._deferred, []
                await self._generate(works)
                continue
            await self._changed.wait()

    async def _eval(self) -> tuple[float, np.ndarray]:
        n = 64
        seeds = [EVAL_SEED + i for i in range(n)]
        res = await self._denoise([self.cond] * n, seeds, [f"eval/{i}" for i in range(n)])
        images = torch.from_numpy(np.stack([r["latents"][-1] for r in res]))
        rew = await asyncio.to_thread(self.reward, images, torch.full((n,), self.cond))
        return float(rew.mean()), images.numpy()

    # ---------------------------------------------------------------- the run
    async def run(self) -> RecipeResult:
        cfg = self.cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.resolved.json").write_text(dump_json(cfg))
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        out = RecipeResult(str(self.dir))
        base, out.pretrain_seconds = await asyncio.to_thread(base_model, cfg, self.dir)
        self.reward: RewardFn = await asyncio.to_thread(load_reward, cfg.reward, str(self.dir))
        prec = cfg.precision
        engine_dtype = dtype_of(prec.engine_dtype, "precision.engine_dtype")
        net = apply_precision(copy.deepcopy(base), engine_dtype, prec.fp32_params)
        engine = DiffusionEngine(net, self.sched, cfg.sampler.max_batch)
        self.trainer = DiffusionTrainer(cfg.trainer, prec, self.sched, base.spec, base.state_dict(),
                                        seed=cfg.run.seed)
        bcfg = cfg.buffer
        if self.lockstep:  # one batch of slots: every group is generated by the weights it trains
            bcfg = dataclasses.replace(bcfg, capacity=bcfg.batch_groups * cfg.n_samples)
        self.buffer = RolloutBuffer.from_config(bcfg, cfg.n_samples, prompt_source=self._next_prompt)
        # SIGUSR1 dumps every task, so a hung run can be asked where it waits. It is a debugging aid only:
        # add_signal_handler raises RuntimeError off the main thread (tests run the recipe in one) and
        # NotImplementedError on loops without signal support, and the run is the same without it.
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
        except (NotImplementedError, RuntimeError) as exc:
            log.debug("sigusr1_task_dump_unavailable", reason=f"{type(exc).__name__}: {exc}")
        tcfg = TransportConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0)
        self.host = Host(tcfg, None)
        await self.host.start()
        sink = MetricsSink(self.dir, tensorboard=False)
        try:
            await self.host.add(Directory(tcfg.heartbeat_timeout_s, tcfg.heartbeat_interval_s), DIRECTORY_NAME)
            await self.host.add(DiffusionEngineActor(engine), ENGINE)
            sync = WeightSync(self.host, cfg.sync, [ENGINE])
            try:
                await self._loop(out, sink, sync, engine_dtype)
            finally:
                await sync.close()
        finally:
            sink.close()
            for t in list(self._inflight):
                t.cancel()
            await asyncio.gather(*self._inflight, return_exceptions=True)
            await self.host.stop()
        out.final_state = self.trainer.state_fp32()
        out.ledger = self.buffer.ledger.counts()
        save_weights_dict(out.final_state, base.spec, self.dir / "final.safetensors")
        return out

    async def _loop(self, out: RecipeResult, sink: MetricsSink, sync: WeightSync, engine_dtype: torch.dtype) -> None:
        cfg = self.cfg
        r0, out.first_images = await self._eval()
        out.eval_rewards.append((0, r0))
        t_start = time.perf_counter()
        self._dispatch(self.buffer.fill())
        for step in range(1, cfg.run.steps + 1):
            t0 = time.perf_counter()
            groups = await self._collect()
            t_wait = time.perf_counter() - t0
            batch = self._batch(groups)
            m = await asyncio.to_thread(self.trainer.train_step, batch)
            rep = await sync.push(self.trainer.weight_version,
                                  self.trainer.export_state(engine_dtype, cfg.precision.fp32_params))
            row: dict[str, Any] = {"step": step, **m, **self.buffer.step_metrics(self.trainer.weight_version)}
            row.update({
                "rollout/reward_mean": float(batch.rewards.mean()),
                "train/train_rollout_logprob_abs_diff": m.get("train/logp_abs_diff"),
                "perf/step_time_s": time.perf_counter() - t0,
                "perf/wait_for_rollout_s": t_wait,
                "perf/sync_s": rep.seconds,
                "perf/elapsed_s": time.perf_counter() - t_start,
                "sync/bytes": float(rep.bytes),
            })
            row.update({f"ledger/{k}": float(v) for k, v in self.buffer.ledger.counts().items()})
            last = step == cfg.run.steps or (cfg.run.time_budget_s and row["perf/elapsed_s"] > cfg.run.time_budget_s)
            if step % cfg.run.eval_every == 0 or last:
                r, imgs = await self._eval()
                out.eval_rewards.append((step, r))
                out.last_images = imgs
                row["eval/reward_mean"] = r
            sink.write(row)
            out.rows.append(row)
            log.info("diffusion_step", step=step, reward=round(row["rollout/reward_mean"], 3),
                     eval=row.get("eval/reward_mean"), seconds=round(row["perf/step_time_s"], 2),
                     staleness=m.get("train/staleness"))
            if last:
                break
        out.seconds = time.perf_counter() - t_start


def save_weights_dict(state: dict[str, torch.Tensor], spec: FlowUNetSpec, path: Path) -> None:
    model = FlowUNet(spec)
    model.load_state_dict(state)
    save_weights(model, path)


def run_recipe(cfg: DiffusionConfig) -> RecipeResult:
    return asyncio.run(DiffusionRecipe(cfg).run())
