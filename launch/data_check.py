"""`miles data check FILE [--config CONFIG]`: validate a data file against the config before a run.

Reads FILE with the dataset env's settings from the config (`rollout.env_args`: field
names, rewards and the labels they accept), checks every row and prints the first bad
line with what is wrong, the number of bad rows, and on success the split sizes and
one prompt as the model will see it. Exit status: 0 clean, 1 bad rows, 2 config error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig

DATASET_ENV = "miles.rollout.envs.dataset:make_env"


def _env_args(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(MilesConfig, args.config, args.set)
    if args.config and cfg.rollout.env != DATASET_ENV:
        raise ConfigError(f"{args.config}: rollout.env is {cfg.rollout.env!r}, not the dataset env "
                          f"{DATASET_ENV!r}; `miles data check` checks files for that env")
    env_args = dict(cfg.rollout.env_args)  # without a config: the defaults plus any --set
    env_args["path"] = args.file
    return env_args


def check_file(env_args: dict[str, Any], show: int = 5) -> tuple[int, list[str]]:
    """Check every row of env_args['path']: (exit status, report lines)."""
    from miles.rollout.envs.dataset import (
        make_dataset,
        parse_config,
        raw_rows,
        row_error,
    )
    from miles.rollout.rewards.rules import build_rewards

    cfg = parse_config(env_args)
    reward = build_rewards(cfg.rewards, "rollout.env_args.rewards")
    path = Path(cfg.path)
    n = 0
    bad: list[tuple[int, str]] = []
    kinds = {"text": 0, "messages": 0}
    for line, obj, err in raw_rows(path, cfg.format):
        n += 1
        err = err or row_error(cfg, obj, reward)
        if err:
            bad.append((line, err))
        else:
            kinds["messages" if isinstance(obj[cfg.prompt_key], list) else "text"] += 1
    types = ", ".join(str(r.get("type")) for r in cfg.rewards)
    if n == 0:
        return 1, [f"{path}: no rows"]
    if bad:
        line, err = bad[0]
        out = [f"{path}:{line}: {err}", f"{len(bad)} bad row(s) of {n}  (rewards: {types})"]
        out += [f"  {path}:{ln}: {e}" for ln, e in bad[1:show]]
        if len(bad) > show:
            out.append(f"  ... and {len(bad) - show} more")
        return 1, out
    train, _ = make_dataset(cfg)
    out = [f"{path}: {n} rows OK ({kinds['text']} text, {kinds['messages']} chat)  rewards: {types}"]
    if cfg.eval_fraction > 0 and not cfg.eval_path:
        out.append(f"split: {len(train.rows)} train / {n - len(train.rows)} eval "
                   f"(eval_fraction {cfg.eval_fraction}, split_seed {cfg.split_seed})")
    first = train.item(0)
    out.append(f"first prompt: {json.dumps(first['messages'])}  label: {json.dumps(first['label'])}")
    return 0, out


def cmd_data_check(args: argparse.Namespace) -> int:
    rc, lines = check_file(_env_args(args))
    print("\n".join(lines), flush=True)
    return rc


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="work with dataset files (check)")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    c = dsub.add_parser("check", help="validate a JSONL/Parquet file against the config's dataset env")
    c.add_argument("file", help="the data file to check (replaces rollout.env_args.path)")
    c.add_argument("--config", default=None, help="TOML config whose rollout.env_args describe the file")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set rollout.env_args.prompt_key=question")
    c.set_defaults(fn=cmd_data_check)
