"""Entry point of one role process: `python -m miles.launch.role ROLE --config resolved.json ...`.

The launcher (local or Slurm) starts one of these per engine, one for the rollout
side and one per trainer rank; each registers its actors with the directory.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import sys
import time
from typing import Any

from miles.actors.runtime.host import Host
from miles.actors.runtime.process import serve
from miles.core.config import from_dict
from miles.core.errors import PeerTimeout
from miles.core.logging import configure_logging, get_logger
from miles.core.schema import MilesConfig

log = get_logger("miles.role")


def engine_names(cfg: MilesConfig) -> list[str]:
    return [f"engine-{i}" for i in range(cfg.engine.num_engines)]


async def _wait_for(host: Host, names: list[str], wait_s: float) -> None:
    """Until every named actor has registered (an engine does so once warmed up): `wait_s` in all
    (engine.ready_wait_s), the roles starting side by side; a timeout names the option."""
    deadline = time.monotonic() + wait_s
    for name in names:
        try:
            await host.lookup(name, timeout=max(0.1, deadline - time.monotonic()))
        except PeerTimeout as exc:
            raise PeerTimeout(f"{exc} (engine.ready_wait_s={wait_s:g}): did it fail to start? see its log") from None


async def _wait_engines(host: Host, cfg: MilesConfig) -> None:
    await _wait_for(host, engine_names(cfg), cfg.engine.ready_wait_s)


def wandb_settings(cfg: MilesConfig) -> Any:
    """The trainer's Weights & Biases settings, or None when `run.wandb_project` is empty."""
    if not cfg.run.wandb_project:
        return None
    from miles.core.config import to_dict
    from miles.metrics.sink import WandbSettings

    return WandbSettings(cfg.run.wandb_project, cfg.run.wandb_mode, cfg.run.name, to_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="miles-role")
    ap.add_argument("role", choices=["engine", "eval_engine", "judge_engine", "rollout", "trainer"])
    ap.add_argument("--config", required=True, help="resolved config JSON written by the launcher")
    ap.add_argument("--index", type=int, default=0, help="engine index or trainer rank")
    ap.add_argument("--directory", default=os.environ.get("MILES_DIRECTORY", ""))
    ap.add_argument("--ready", default="")
    a = ap.parse_args(argv)
    # A segfault in native code (a CUDA IPC open, a kernel, an extension) kills the process with no
    # Python traceback: faulthandler writes the stacks to stderr (the role's log) as it dies, and
    # the supervisor reads them back as the crash's cause (launch/supervision.py `crash_report`).
    faulthandler.enable(all_threads=True)
    with open(a.config) as f:
        cfg = from_dict(MilesConfig, json.load(f))
    configure_logging(cfg.run.log_level, cfg.run.json_logs, run=cfg.run.name, role=a.role, rank=a.index)
    import uvloop

    stop = asyncio.Event()
    code = {"rc": 0}
    tasks: set[asyncio.Task[None]] = set()  # held here: the loop keeps only weak references

    async def setup(host: Host) -> None:
        if a.role == "judge_engine":  # the judge pool's: a frozen model, never sent weights
            from miles.actors.engine import EngineActor
            from miles.engines.torch_engine import TorchEngine

            rm = cfg.reward_model
            engine = TorchEngine.from_config(rm.engine_config(cfg.engine), rm.model_config(cfg.model))
            await engine.warm_up()
            await host.add(EngineActor(engine), f"judge-{a.index}")
        elif a.role in ("engine", "eval_engine"):
            from miles.actors.engine import EngineActor
            from miles.engines.base import ENGINES

            if cfg.engine.mps_thread_percent:  # read when the CUDA context is created (validated at launch)
                os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg.engine.mps_thread_percent)
            if cfg.engine.device.startswith("cuda"):
                import torch

                from miles.engines.mps_check import check_gemms_under_sm_limit

                if cfg.engine.device.startswith("cuda:"):
                    # NCCL groups (broadcast weight sync) use the current device: make it the engine's.
                    torch.cuda.set_device(cfg.engine.device)
                if cfg.engine.mps_thread_percent:
                    check_gemms_under_sm_limit(torch.device(cfg.engine.device), cfg.engine.mps_thread_percent)
            # each engine its own server port (and GPUs); a snapshot eval engine comes after the others
            index = cfg.engine.num_engines if a.role == "eval_engine" else a.index
            engine = ENGINES.get(cfg.engine.type).from_config(cfg.engine.for_engine(index), cfg.model)
            try:
                # before it is found: compiles and a server's start must not eat the first requests' deadlines
                await engine.warm_up()
            except BaseException:
                await engine.close()  # a launched server is not left behind; the error is reported below
                raise

            def lost(exc: BaseException) -> None:  # an engine that cannot be brought back ends the role
                from miles.launch.supervision import report_crash

                report_crash(exc, started=True)
                code["rc"] = 1
                stop.set()

            engine.on_lost = lost
            name = "eval-engine" if a.role == "eval_engine" else f"engine-{a.index}"
            await host.add(EngineActor(engine), name)
        elif a.role == "rollout":
            from miles.actors.rollout import RolloutActor
            from miles.rollout.tokens.tokenizer import load_tokenizer

            await _wait_engines(host, cfg)
            tok = load_tokenizer(cfg.model.path)
            judge_tok = None
            if cfg.reward_model.num_engines:  # the judges are ready before the first reward needs them
                from miles.rollout.rewards.judge import judge_names

                await _wait_for(host, judge_names(cfg.reward_model.num_engines), cfg.engine.ready_wait_s)
                judge_tok = load_tokenizer(cfg.reward_model.model_config(cfg.model).path)
            actor = RolloutActor(cfg, engine_names(cfg), tok, judge_tok)
            resume = os.environ.get("MILES_RESUME", "")
            if resume:
                with open(os.path.join(resume, "rollout_state.json")) as f:
                    state = json.load(f)
                actor.resume_from(state, f"{resume}/rollout_state.json")
                log.info("rollout_resumed", checkpoint=resume)
            await host.add(actor, "rollout")
        else:
            from miles.actors.trainer import TrainerActor
            from miles.metrics.sink import MetricsSink
            from miles.models.config import ModelSpec

            # the rollout process registers once the engines have: one bound for both
            await _wait_for(host, [*engine_names(cfg), "rollout"], cfg.engine.ready_wait_s)
            from miles.metrics.run_dir import checkpoint_step

            resume = os.environ.get("MILES_RESUME", "")
            sink = MetricsSink(cfg.run.dir, wandb=wandb_settings(cfg),
                               resume_step=checkpoint_step(resume) if resume else None) if a.index == 0 else None
            done = asyncio.Event()
            trainer = TrainerActor(cfg, ModelSpec.from_dir(cfg.model.path), a.index, cfg.trainer.world_size,
                                   engine_names(cfg), cfg.model.path, done, sink,
                                   resume_from=os.environ.get("MILES_RESUME", ""))

            async def finish() -> None:
                await done.wait()
                code["rc"] = 1 if trainer.error is not None else 0
                if sink is not None:
                    sink.close()
                stop.set()

            tasks.add(asyncio.create_task(finish()))
            await host.add(trainer, f"trainer-{a.index}")
        code["started"] = 1  # its actors serve: a crash from now on is not a failure at start

    try:
        rc = uvloop.run(serve(setup, cfg=cfg.transport, directory=a.directory, ready_file=a.ready,
                              stop_event=stop))
    except Exception as exc:  # noqa: BLE001 - reported for the supervisor (launch/supervision.py), then exit 1
        from miles.launch.supervision import report_crash

        report_crash(exc, started=bool(code.get("started")))
        return 1
    return code["rc"] or rc


def exit_now(code: int) -> None:
    """End the process once its host has stopped, without interpreter teardown.

    Everything a role writes is closed by then (metrics, ledger, final checkpoint, logs), and
    the exit handlers still run; what is skipped is the finalisation of torch and the
    joining of idle worker threads, which took ~2 s per process on 2 busy cores, while the
    launcher waits for every role to exit before it prints the summary.
    """
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
