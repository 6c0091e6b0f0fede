"""Typed config: dataclass trees loaded from TOML, `--set a.b=c` overrides, dumps and docs.

Every field is declared with `opt(default, doc, unit)`. Loading is strict: an
unknown key or a value of the wrong type raises `ConfigError` naming the dotted
path and what would have been valid.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

from miles.core.config_paths import resolve_dotted, resolve_table, with_default_paths
from miles.core.errors import ConfigError
from miles.core.typecheck import convert

T = TypeVar("T")


def opt(default: Any, doc: str, unit: str = "") -> Any:
    """A config field: default, one-line doc, and unit ('' when dimensionless)."""
    meta = {"doc": doc, "unit": unit}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        proto = default
        if dataclasses.is_dataclass(default):
            return dataclasses.field(default_factory=type(default), metadata=meta)
        return dataclasses.field(default_factory=lambda: _deep_copy(proto), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type[T], doc: str) -> Any:
    """A nested config section."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "unit": ""})


def _deep_copy(v: Any) -> Any:
    return json.loads(json.dumps(v))


def _hints(cls: type) -> dict[str, Any]:
    """The types of a section's fields (a base class's annotations, e.g. values the loader
    derives, are not keys)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against type `tp` and convert it (int->float only): sections are built here
    (unknown keys are errors); every other value goes through the one type checker."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table (section), got {type(value).__name__}")
        return _build(tp, value, path)
    return convert(value, tp, path, ConfigError)


def _removed(cls: Any, key: str, where: str) -> None:
    """A section lists keys it no longer has in REMOVED_KEYS (key -> where the setting went)."""
    why = getattr(cls, "REMOVED_KEYS", {}).get(key)
    if why:
        raise ConfigError(f"config key {where!r} was removed: {why}")


def _build(cls: type[T], data: dict[str, Any], path: str) -> T:
    hints = _hints(cls)
    names = list(hints)  # the fields, in order
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            _removed(cls, key, where)
            raise ConfigError(f"unknown config key {where!r}; valid keys here: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, where)
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path or '<root>'}: {exc}") from exc
    return obj


def _parse_scalar(text: str) -> Any:
    """Parse an override value as TOML (numbers, bools, lists, quoted strings); else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _field_type(cls: type, dotted: str) -> Any:
    tp: Any = cls
    for i, part in enumerate(dotted.split(".")):
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                where = ".".join(dotted.split(".")[: i + 1])
                _removed(tp, part, where)
                raise ConfigError(f"unknown config key {where!r}; valid keys here: {', '.join(hints)}")
            tp = hints[part]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            raise ConfigError(f"--set {dotted}: {part!r} is below a non-table value")
    return tp


def apply_overrides(cls: type, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply 'a.b.c=value' overrides onto a raw dict, typed by the schema of `cls`; a relative
    path among them is made absolute against the working directory."""
    for item in overrides:
        if "=" not in item:
            # the example is a key of every config (miles train and miles diffusion alike)
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set run.steps=100")
        key, _, raw = item.partition("=")
        key = key.strip()
        tp = _field_type(cls, key)
        value = _parse_scalar(raw.strip())
        if tp is str and not isinstance(value, str):
            value = raw.strip()  # a str field given `123` means the string "123"
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a table")
        # a path on the command line means one under the caller's directory (core/config_paths.py)
        node[parts[-1]] = resolve_dotted(cls, key, value, Path.cwd())
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load `cls` from a TOML file (optional) plus overrides; strict and typed. A relative path
    in the file is made absolute against the file's directory, one in an override against the
    working directory (core/config_paths.py)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path).absolute()
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from exc
        data = resolve_table(cls, data, p.parent)
    data = apply_overrides(cls, data, overrides or [])
    return _build(cls, with_default_paths(cls, data, Path.cwd()), "")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    return _build(cls, data, "")


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def dump_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), indent=2, sort_keys=False)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if v is None:
        raise ConfigError("None cannot be written to TOML")
    raise ConfigError(f"cannot write {type(v).__name__} to TOML")


def dump_toml(obj: Any, with_docs: bool = False) -> str:
    """The resolved config as TOML; with_docs adds each field's doc and unit as a comment."""
    lines: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        scalars: list[tuple[Any, Any]] = []
        tables: list[tuple[Any, Any]] = []
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            (tables if dataclasses.is_dataclass(v) else scalars).append((f, v))
        if prefix and scalars:
            lines.append(f"\n[{prefix}]")
        for f, v in scalars:
            if with_docs:
                unit = f" [{f.metadata.get('unit')}]" if f.metadata.get("unit") else ""
                lines.append(f"# {f.metadata.get('doc', '')}{unit}")
            if v is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(v)}")
        for f, v in tables:
            walk(v, f"{prefix}.{f.name}" if prefix else f.name)

    walk(obj, "")
    return "\n".join(lines).lstrip("\n") + "\n"


def check_documented(cls: type, path: str = "") -> list[str]:
    """Fields that lack a doc (for a test that keeps every option documented)."""
    missing = []
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if not f.metadata.get("doc"):
            missing.append(where)
        tp = _hints(cls)[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            missing += check_documented(tp, where)
    return missing
