"""Prompts from a JSONL or Parquet file, scored by named rule rewards: train on your own data.

    [rollout]
    env = "miles.rollout.envs.dataset:make_env"
    env_args = {path = "data.jsonl", prompt_key = "question", label_key = "answer",
                rewards = [{type = "math"}]}

Every row holds a prompt (plain text, or a list of chat messages) and a label. The file
is read and checked once at start-up; a bad row stops the launch with its line number.
Prompt i is row `order(seed, epoch)[i % n]` with `epoch = i // n`: a fresh seeded shuffle
every epoch, a pure function of (seed, i), so the data position is one integer that
checkpoints save. A seeded split (`split_seed`, independent of `seed`) holds out
`eval_fraction` of the rows for `split = "eval"` (what `[eval] env_args` selects), or
`eval_path` names a separate eval file. The eval split is served in file order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import xxhash

from miles.core.config import from_dict, opt
from miles.core.errors import ConfigError
from miles.core.logging import get_logger
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.layers import Prompt
from miles.rollout.rewards.rules import CombinedReward, build_rewards

log = get_logger("miles.dataset")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class DatasetEnvConfig:
    path: str = opt("", "the data file: .jsonl (one JSON object a line) or .parquet (needs pyarrow)")
    format: Literal["auto", "jsonl", "parquet"] = opt("auto", "file format; auto = from the extension")
    prompt_key: str = opt("prompt", "field holding the prompt: a string or a list of {role, content} messages")
    label_key: str = opt("answer", "field holding the label the rewards compare against")
    id_key: str = opt("", "field holding a row id; empty = '<file stem>-<row number>'")
    system_prompt: str = opt("", "system message put before every prompt that has none; empty = none")
    prompt_template: str = opt("{prompt}", "template for plain-text prompts; {prompt} is the row's text")
    rewards: list[dict[str, Any]] = opt(
        [{"type": "math"}], "named rule rewards summed with their weights, e.g. [{type = \"math\"}, "
        "{type = \"format\", weight = 0.1}]; types: math, exact, normalized, multiple_choice, format, code_tests")
    seed: int = opt(0, "shuffle seed (a new order every epoch)")
    shuffle: bool = opt(True, "shuffle the train split every epoch; false = file order")
    split: Literal["train", "eval"] = opt("train", "which rows to serve: train, or the held-out eval rows")
    eval_fraction: float = opt(0.0, "fraction of the file's rows held out as the eval split", "fraction")
    eval_path: str = opt("", "a separate eval file (same fields); used instead of eval_fraction")
    split_seed: int = opt(0, "seed of the train/eval split (kept apart from `seed`, so the split never moves)")
    agent: str = opt("miles.rollout.layers:single_turn_agent", "agent layer this env runs with")

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: name the data file, e.g. env_args.path = \"data/train.jsonl\"")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain {{prompt}}, got {self.prompt_template!r}")


class DataError(ConfigError):
    """A data file row is malformed; the message names the file and line."""


@dataclass
class Row:
    line: int  # 1-based line (JSONL) or row (Parquet) number in its file
    messages: list[dict[str, Any]]
    label: Any
    id: str


def file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise ConfigError(f"{path}: cannot tell the format from the extension {path.suffix!r}; "
                      "set env_args.format = \"jsonl\" or \"parquet\"")


def raw_rows(path: Path, fmt: str) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, decoded object or None, error) for each non-blank row of the file."""
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    if file_format(path, fmt) == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'miles[parquet]', "
                              "or convert the file to JSONL") from exc
        for i, obj in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, obj, None
        return
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, None, f"not UTF-8 (byte {exc.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield i, None, f"not valid JSON ({exc.msg} at column {exc.colno})"


def row_error(cfg: DatasetEnvConfig, obj: Any, reward: CombinedReward) -> str | None:
    """What is wrong with one decoded row under `cfg`, or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    fields = ", ".join(map(str, obj)) or "none"
    if cfg.prompt_key not in obj:
        return f"missing the prompt field {cfg.prompt_key!r} (fields: {fields}); set env_args.prompt_key"
    p = obj[cfg.prompt_key]
    if isinstance(p, str):
        if not p.strip():
            return f"empty prompt in {cfg.prompt_key!r}"
    elif isinstance(p, list):
        if not p:
            return f"{cfg.prompt_key!r} is an empty message list"
        for k, m in enumerate(p):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return f"{cfg.prompt_key!r} message {k} must be an object with 'role' and 'content'"
            if m["role"] not in ROLES:
                return f"{cfg.prompt_key!r} message {k} has role {m['role']!r}; valid: {', '.join(ROLES)}"
            if not isinstance(m["content"], str):
                return f"{cfg.prompt_key!r} message {k} content must be a string, got {type(m['content']).__name__}"
        if p[-1]["role"] == "assistant":
            return f"{cfg.prompt_key!r}: the last message is the assistant's; the model has nothing to answer"
    else:
        return f"{cfg.prompt_key!r} must be a string or a list of messages, got {type(p).__name__}"
    if reward.needs_label:
        if cfg.label_key not in obj or obj[cfg.label_key] is None:
            return f"missing the label field {cfg.label_key!r} (fields: {fields}); set env_args.label_key"
        if err := reward.check_label(obj[cfg.label_key]):
            return err
    try:  # labels travel in prompts, which checkpoints save as JSON
        json.dumps(obj.get(cfg.label_key))
    except (TypeError, ValueError):
        return f"label {cfg.label_key!r} of type {type(obj.get(cfg.label_key)).__name__} is not JSON-serialisable"
    if cfg.id_key and cfg.id_key not in obj:
        return f"missing the id field {cfg.id_key!r} (fields: {fields})"
    return None


def to_row(cfg: DatasetEnvConfig, line: int, obj: dict[str, Any], stem: str) -> Row:
    p = obj[cfg.prompt_key]
    if isinstance(p, str):
        messages = [{"role": "user", "content": cfg.prompt_template.replace("{prompt}", p)}]
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in p]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    rid = str(obj[cfg.id_key]) if cfg.id_key else f"{stem}-{line}"
    return Row(line, messages, obj.get(cfg.label_key), rid)


def load_rows(cfg: DatasetEnvConfig, path: Path, reward: CombinedReward) -> tuple[list[Row], str]:
    """Every row of `path`, checked; the first bad one raises DataError naming its line."""
    rows: list[Row] = []
    h = xxhash.xxh64()
    for line, obj, err in raw_rows(path, cfg.format):
        err = err or row_error(cfg, obj, reward)
        if err:
            raise DataError(f"{path}:{line}: {err}  (check the whole file with `miles data check {path}`)")
        rows.append(to_row(cfg, line, obj, path.stem))
        h.update(json.dumps(obj, sort_keys=True, default=str).encode())
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows, h.hexdigest()


def split_rows(cfg: DatasetEnvConfig, rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """(train, eval) under `eval_fraction` and `split_seed`; each keeps file order."""
    n_eval = round(len(rows) * cfg.eval_fraction)
    if cfg.eval_fraction > 0 and not 0 < n_eval < len(rows):
        raise ConfigError(f"eval_fraction {cfg.eval_fraction} of {len(rows)} rows leaves an empty split")
    held = set(random.Random(cfg.split_seed).sample(range(len(rows)), n_eval))
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


@dataclass
class DatasetPrompts(SeededPrompts):
    """Rows served epoch after epoch, reshuffled per epoch by (seed, epoch)."""

    env_name = "dataset"

    rows: list[Row]
    seed: int = 0
    shuffle: bool = True
    fingerprint: str = ""
    position: int = 0
    _epoch: int = field(default=-1, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)

    def order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order

    def __len__(self) -> int:
        """Rows in one epoch: a full evaluation decodes items 0 .. len - 1, each row once."""
        return len(self.rows)

    def item(self, i: int) -> Prompt:
        epoch, k = divmod(i, len(self.rows))
        r = self.rows[self.order(epoch)[k]]
        label = r.label
        return {"id": f"{r.id}@{epoch}", "index": i, "row": r.id, "epoch": epoch, "messages": r.messages,
                "label": label, "answer": label if isinstance(label, str) else json.dumps(label)}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "rows": len(self.rows), "fingerprint": self.fingerprint}

    def load_state(self, state: dict[str, Any]) -> None:
        if "rows" in state and state["rows"] != len(self.rows):
            raise ConfigError(f"dataset env: the checkpoint was taken over {state['rows']} rows, the data now "
                              f"has {len(self.rows)}; the saved position would point at other rows")
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            log.warning("dataset_changed_since_checkpoint", rows=len(self.rows))
        super().load_state(state)


def make_dataset(cfg: DatasetEnvConfig) -> tuple[DatasetPrompts, CombinedReward]:
    reward = build_rewards(cfg.rewards, "rollout.env_args.rewards")
    path = Path(cfg.path)
    rows, fp = load_rows(cfg, path, reward)
    if cfg.eval_path:
        if cfg.split == "eval":
            rows, fp = load_rows(cfg, Path(cfg.eval_path), reward)
    elif cfg.eval_fraction > 0:
        train, held = split_rows(cfg, rows)
        rows = held if cfg.split == "eval" else train
    shuffle = cfg.shuffle and cfg.split == "train"
    return DatasetPrompts(rows, cfg.seed, shuffle, fp), reward


def parse_config(env_args: dict[str, Any]) -> DatasetEnvConfig:
    try:
        return from_dict(DatasetEnvConfig, env_args)
    except ConfigError as exc:
        raise ConfigError(f"rollout.env_args (dataset env): {exc}") from exc


def make_env(**env_args: Any) -> Environment:
    cfg = parse_config(env_args)
    prompts, reward = make_dataset(cfg)
    return Environment(f"dataset:{Path(cfg.path).stem}", prompts, reward, cfg.agent)
