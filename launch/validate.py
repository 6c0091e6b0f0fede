"""Checks made at launch, before any process starts: hooks import, sections agree.

Each failure is one `ConfigError` naming the option and the fix, so a wrong config
never costs a cluster allocation.
"""

from __future__ import annotations

from pathlib import Path

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig


def validate_launch(cfg: MilesConfig) -> None:
    asynchronous = cfg.buffer.mode != "sync"
    from miles.trainer.backends import check_backend, check_lora_launch

    # the model's architecture is known here only from a given model.path (the tiny preset is
    # written later); the trainer re-checks the parallel sizes against it when it starts
    spec = None
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        from miles.models.config import ModelSpec  # imports torch: only with a model to read

        spec = ModelSpec.from_dir(cfg.model.path)
    check_backend(cfg.trainer, spec, asynchronous, cfg.trainer.world_size)
    check_lora_launch(cfg)  # the trainer re-checks when it starts (Slurm roles skip this process)
    env = resolve_hook(cfg.rollout.env, "rollout.env")(**cfg.rollout.env_args)
    agent = cfg.rollout.agent_fn or env.agent
    if "openai_agent" in agent and not cfg.rollout.http_front:
        raise ConfigError(f"rollout agent {agent!r} talks to the session server over HTTP: "
                          "set rollout.http_front = true")
    for field in ("agent_fn", "generate_fn", "reward_fn"):
        path = getattr(cfg.rollout, field)
        if path:
            resolve_hook(path, f"rollout.{field}")
    if cfg.buffer.filter_fn:
        resolve_hook(cfg.buffer.filter_fn, "buffer.filter_fn")
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path!r} has no config.json: point it at an HF model "
                          "directory, or leave it empty to start from the tiny preset")
    if cfg.trainer.true_on_policy and not getattr(cfg.engine, "batch_invariant", False):
        raise ConfigError("trainer.true_on_policy needs engine.batch_invariant = true: the engine must use "
                          "the same batch-invariant kernels for logprobs to match bit for bit")
    if not 0 <= cfg.engine.mps_thread_percent <= 100:
        raise ConfigError(f"engine.mps_thread_percent={cfg.engine.mps_thread_percent}: expected 0 (no limit) "
                          "to 100 (% of the GPU's SMs)")
    from miles.launch.sglang_checks import sglang_launch_errors

    sglang = sglang_launch_errors(cfg)
    if sglang:
        raise ConfigError("; ".join(sglang))
    if cfg.trainer.pause_engines and cfg.engine.type != "torch":
        raise ConfigError(f"trainer.pause_engines pauses engines in place (requests and KV kept), which "
                          f"engine.type = {cfg.engine.type!r} does not offer: use the torch engine or turn it off")
    if cfg.eval.mode == "external" and not cfg.eval.command:
        raise ConfigError("eval.mode = 'external' needs eval.command, e.g. "
                          "'python my_eval.py --model {checkpoint}'")
    if cfg.run.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"run.wandb_project = {cfg.run.wandb_project!r} needs the wandb package: "
                              "pip install 'miles[wandb]' (or leave run.wandb_project empty)")
    if cfg.eval.mode != "none" and cfg.eval.every_steps < 1:
        raise ConfigError(f"eval.every_steps must be >= 1, got {cfg.eval.every_steps}")
    if cfg.run.time_limit_s < 0 or (cfg.run.time_limit_s > 0 and cfg.trainer.world_size > 1):
        raise ConfigError(f"run.time_limit_s = {cfg.run.time_limit_s}: must be >= 0, and > 0 only with one "
                          f"trainer rank (ranks would stop at different steps), got world_size "
                          f"{cfg.trainer.world_size}")
    if cfg.eval.samples < 0:
        raise ConfigError(f"eval.samples must be >= 0 (0 = greedy only), got {cfg.eval.samples}")
    from miles.models.fp8_checks import fp8_launch_errors

    fp8 = fp8_launch_errors(cfg)
    if fp8:
        raise ConfigError("; ".join(fp8))
