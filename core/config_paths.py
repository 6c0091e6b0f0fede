"""Where a relative path in a config points: the config file's directory, or the caller's.

A relative path written in a config file means a place beside that file, wherever the command
runs (`examples/dataset.toml` names `data/word_problems.jsonl` beside itself); a relative path
given on the command line (`--set`) means a place under the caller's working directory, as
every shell argument does. Both are made absolute when the config is loaded, so every process
of a run (started elsewhere, or on another node) and every error message sees the one place
that was meant. A relative default (run.dir = "runs/latest") is from the working directory, and
made absolute too: after loading, every path a config holds is absolute (so a dumped config
loads back the same from any folder).

Which values are paths:
- every option declared with unit "path" (`opt(..., "path")`);
- in a free-form table (`rollout.env_args`, `eval.env_args`: keyword arguments of a user's
  `make_env`), the keys `path`, `*_path`, `*_file` and `*_dir`: the schema cannot know an env's
  arguments, so the names say it.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

PATH_UNIT = "path"
PATH_KEY_SUFFIXES = ("_path", "_file", "_dir")


def is_path_key(key: str) -> bool:
    """A key of a free-form table that names a file or directory."""
    return key == "path" or key.endswith(PATH_KEY_SUFFIXES)


def absolute(value: str, base: Path) -> str:
    """`value` against `base` (already absolute), '~' expanded; '' (= unset) and absolute paths as given."""
    return os.path.normpath(base / Path(value).expanduser()) if value else value


def _fields(cls: type) -> dict[str, tuple[Any, dict[str, Any]]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)}


def _is_free_table(tp: Any) -> bool:
    return get_origin(tp) is dict and get_args(tp)[1:] == (Any,)


def resolve_value(tp: Any, meta: dict[str, Any], value: Any, base: Path) -> Any:
    """One raw (TOML) value of a field of type `tp`, its paths made absolute against `base`."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return resolve_table(tp, value, base)
    if meta.get("unit") == PATH_UNIT and isinstance(value, str):
        return absolute(value, base)
    if _is_free_table(tp) and isinstance(value, dict):
        return {k: absolute(v, base) if is_path_key(k) and isinstance(v, str) else v for k, v in value.items()}
    return value


def resolve_table(cls: type, data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A raw table of section `cls` with every path in it absolute; unknown keys are kept as
    they are (the loader names them as errors)."""
    fields = _fields(cls)
    out = dict(data)
    for key, value in data.items():
        if key in fields:
            tp, meta = fields[key]
            out[key] = resolve_value(tp, meta, value, base)
    return out


def resolve_dotted(cls: type, dotted: str, value: Any, base: Path) -> Any:
    """The value of `--set dotted=value` with its paths absolute against `base`."""
    tp: Any = cls
    meta: dict[str, Any] = {}
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if part not in fields:
                return value  # the loader names the unknown key
            tp, meta = fields[part]
        elif _is_free_table(tp) and i == len(parts) - 1:
            return absolute(value, base) if is_path_key(part) and isinstance(value, str) else value
        else:
            return value
    return resolve_value(tp, meta, value, base)


def with_default_paths(cls: type, data: dict[str, Any], base: Path) -> dict[str, Any]:
    """`data` plus every path option it does not set whose default is a non-empty path, made
    absolute against `base` (the working directory)."""
    out = dict(data)
    for f in dataclasses.fields(cls):
        tp, meta = _fields(cls)[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            sub = data.get(f.name, {})
            if isinstance(sub, dict):
                filled = with_default_paths(tp, sub, base)
                if filled:
                    out[f.name] = filled
        elif meta.get("unit") == PATH_UNIT and f.name not in data and isinstance(f.default, str) and f.default:
            out[f.name] = absolute(f.default, base)
    return out
