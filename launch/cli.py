"""The `miles` command line: train, launch (Slurm), config, check-template, bench, fetch-model."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

from miles.core.config import dump_toml, load_config
from miles.core.errors import MilesError
from miles.core.logging import configure_logging
from miles.core.schema import MilesConfig

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The positional CONFIG and repeated --set KEY=VALUE every config-taking command accepts."""
    p.add_argument("config", nargs="?", default=None, help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.optim.lr=1e-6")


def _load(args: argparse.Namespace) -> MilesConfig:
    return load_config(MilesConfig, args.config, args.set)


def load_run(args: argparse.Namespace, local: bool = True) -> tuple[MilesConfig, str] | None:
    """The run `miles train` and `miles launch --slurm` start, refused before anything is written
    or submitted if its config is wrong: the config and its `--resume` checkpoint ("" for a fresh
    run, which needs an empty run.dir), or None for a `--resume` of a run that already finished.
    `local`: every role runs on this machine (`miles train`; see `validate_launch`)."""
    from miles.launch.validate import validate_launch
    from miles.metrics import run_dir as rd

    resume = ""
    if args.resume:
        cfg, resume = _resume_config(args.resume, args.set)
        if not resume:  # finished (see metrics/run_dir.py)
            return None
    else:
        cfg = _load(args)
    validate_launch(cfg, local)  # first: a wrong config is named before anything about the run directory
    if not resume:
        rd.check_fresh(cfg.run.dir)  # one run per directory: never append to another run's files
    return cfg, resume


def begin_resume(cfg: MilesConfig, resume: str) -> None:
    """The steps after the checkpoint run again: drop what they wrote before."""
    from miles.metrics import run_dir as rd

    if resume:
        rd.truncate_step_records(cfg.run.dir, rd.checkpoint_step(resume))


def cmd_train(args: argparse.Namespace) -> int:

    from miles.launch.local import LocalLauncher
    from miles.warmup.sft import with_initial_checkpoint

    loaded = load_run(args)  # before anything is written: a refused run leaves no run directory
    if loaded is None:
        return 0
    cfg, resume = loaded
    begin_resume(cfg, resume)
    # file: events as JSON to run_dir/logs/launcher.log, warnings and errors as one line each here
    configure_logging(cfg.run.log_level, cfg.run.json_logs, file=cfg.run.launcher_log(), run=cfg.run.name,
                      role="launcher")
    if not resume:
        cfg = with_initial_checkpoint(cfg)
    rc = asyncio.run(LocalLauncher(cfg, resume_from=resume).run())
    from miles.launch.report import finish_run

    # report.html (inline SVG plots) and the summary table; PNGs: miles report RUN_DIR --png
    print(finish_run(cfg.run.dir), flush=True)
    if rc == 130:
        print(interrupted_note(cfg.run.dir), flush=True)
    return rc


def interrupted_note(run_dir: str) -> str:
    """What a stopped run (Ctrl-C, SIGTERM) tells its user: where it can go on from, and the command."""
    from miles.metrics import run_dir as rd

    step = rd.latest_checkpoint_step(run_dir)
    if step is None:
        return ("miles: stopped before its first checkpoint, so it cannot be resumed; set "
                "trainer.checkpoint_interval = N (steps) to make a run resumable")
    return f"miles: stopped; the last checkpoint is step {step}. Resume with:\n  {rd.resume_command(run_dir)}"


def _resume_config(run_dir: str, overrides: list[str]) -> tuple[MilesConfig, str]:
    """The config a run was started with (plus overrides) and its newest complete checkpoint;
    no checkpoint ("") for a run that already finished all its steps (said on stdout)."""
    import json

    from miles.actors.trainer import latest_checkpoint
    from miles.core.config import apply_overrides, from_dict
    from miles.core.errors import ConfigError

    resolved = Path(run_dir) / "config.resolved.json"
    if not resolved.is_file():
        raise ConfigError(f"--resume {run_dir!r}: no config.resolved.json there; is it a miles run directory?")
    data = apply_overrides(MilesConfig, json.loads(resolved.read_text()), overrides)
    data.setdefault("run", {})["dir"] = str(Path(run_dir).absolute())  # absolute, as a loaded config
    cfg = from_dict(MilesConfig, data)
    from miles.metrics.run_dir import finished_at

    done = finished_at(run_dir, cfg.run.steps)
    if done is not None:
        print(f"miles: {run_dir} already finished (step {done} of run.steps={cfg.run.steps}); nothing to "
              f"resume. To train further: miles train --resume {run_dir} --set run.steps=N with N > {done}",
              flush=True)
        return cfg, ""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"--resume {run_dir!r}: no checkpoint yet; set trainer.checkpoint_interval "
                          "to a number of steps so runs can be resumed")
    return cfg, str(ckpt)


def cmd_config(args: argparse.Namespace) -> int:
    # the trainer's device-dependent values stay 'auto' here: each trainer resolves them for the
    # device it sees (core/schema/runtime.py) and records them in the run directory's config
    print(dump_toml(_load(args), with_docs=True), end="")
    return 0


def cmd_check_template(args: argparse.Namespace) -> int:
    from miles.rollout.tokens.template_check import check_template
    from miles.rollout.tokens.tokenizer import load_tokenizer

    report = check_template(load_tokenizer(args.model_dir))
    print(report.summary())
    return 0 if report.ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    script = BENCH_DIR / f"{args.name}.py"
    if not script.is_file():
        names = sorted(p.stem for p in BENCH_DIR.glob("*.py"))
        print(f"miles bench: no benchmark named {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.rest])


# Subcommands defined in their own modules: each exposes `add_parser(subparsers)`, which
# registers the command and sets `fn` (args -> exit code). Add one line per module.
SUBCOMMAND_MODULES: list[str] = [
    "miles.launch.slurm",
    "miles.perftest.cli",
    "miles.launch.data_check",
    "miles.launch.report",
    "miles.diffusion.cli",
    "miles.packaged.fetch",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="miles", description="fully asynchronous RL post-training")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="run every role as local processes")
    add_config_args(p)
    p.add_argument("--resume", default="", metavar="RUN_DIR",
                   help="continue RUN_DIR from its last checkpoint (trainer, buffer ledger, data position)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("config", help="print the resolved config with every option's doc and unit")
    add_config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("check-template", help="verify a tokenizer's chat template is append-only")
    p.add_argument("model_dir")
    p.set_defaults(fn=cmd_check_template)
    if BENCH_DIR.is_dir():  # a checkout: an installed wheel holds no bench/, so offers no `bench`
        p = sub.add_parser("bench", help="run a benchmark script from bench/")
        p.add_argument("name")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=cmd_bench)
    import importlib

    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod).add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except MilesError as exc:
        print(f"miles: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
