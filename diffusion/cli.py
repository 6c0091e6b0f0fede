"""`miles diffusion CONFIG [--set a.b=c]`: run the diffusion RL recipe (diffusion/recipe.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def cmd_diffusion(args: argparse.Namespace) -> int:
    from miles.core.config import dump_toml, load_config
    from miles.core.logging import configure_logging
    from miles.diffusion.config import DiffusionConfig

    cfg = load_config(DiffusionConfig, args.config, args.set)
    if args.print_config:
        print(dump_toml(cfg, with_docs=True), end="")
        return 0
    from pathlib import Path

    # every event as JSON to run_dir/logs/diffusion.log; the console gets info and up (the step
    # lines included) as one readable line each, whether or not stderr is a terminal
    configure_logging(cfg.run.log_level, None, file=Path(cfg.run.dir) / "logs" / "diffusion.log",
                      console_level="info", run=cfg.run.name, role="diffusion")
    from miles.diffusion.plots import write_diffusion_plots
    from miles.diffusion.recipe import run_recipe
    from miles.metrics.plots import write_plots

    res = run_recipe(cfg)
    plots = write_plots(res.run_dir) + write_diffusion_plots(
        res.run_dir, res.rows, res.eval_rewards, res.first_images, res.last_images, cfg.run.name)
    first, last = res.eval_rewards[0][1], res.eval_rewards[-1][1]
    print(f"eval reward {first:.3f} -> {last:.3f} in {len(res.rows)} steps, {res.seconds:.0f} s "
          f"(+ {res.pretrain_seconds:.0f} s pretraining); ledger {json.dumps(res.ledger)}", flush=True)
    print(f"run dir: {res.run_dir}  (metrics.jsonl, {len(plots)} plots, final.safetensors)", flush=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diffusion", help="diffusion RL: GRPO over denoising trajectories of a small flow model",
                       description=__doc__)
    p.add_argument("config", nargs="?", default=None, help="TOML config file (e.g. examples/diffusion.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.lr=1e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved config with docs and exit")
    p.set_defaults(fn=cmd_diffusion)
