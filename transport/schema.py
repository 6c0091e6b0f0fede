"""Typed message records: registration and validation through the one type checker.

A message type is a dataclass registered with `@message`. Decoding a record
checks field names and every value's type against the dataclass hints
(`core/typecheck.py`, the same rules as the config), so a handler only ever
sees well-formed input.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, get_args

import msgspec

from miles.core.errors import ProtocolError
from miles.core.typecheck import convert

MAX_DEPTH = 32  # nesting allowed inside free-form (Any) fields


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSpec:
    name: str
    version: int
    cls: type
    fields: tuple[str, ...]
    names: frozenset[str]
    required: frozenset[str]
    free_form: tuple[str, ...]  # fields whose hint holds Any: their nesting depth is bounded


_BY_NAME: dict[str, MessageSpec] = {}
_BY_CLS: dict[type, MessageSpec] = {}


def _holds_any(tp: Any) -> bool:
    return tp is Any or tp is object or any(_holds_any(a) for a in get_args(tp))


def message(name: str | None = None, version: int = 1) -> Callable[[type], type]:
    """Register a dataclass as a wire message type (name defaults to the class name)."""

    def wrap(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            cls = dataclasses.dataclass(cls)
        spec_name = name or cls.__name__
        if spec_name in _BY_NAME and _BY_NAME[spec_name].cls is not cls:
            raise ValueError(f"message type {spec_name!r} registered twice")
        hints = typing.get_type_hints(cls)
        try:
            msgspec.inspect.type_info(cls)  # every field hint must be checkable: fail at import
        except TypeError as exc:
            raise TypeError(f"message {spec_name!r}: unsupported field type: {exc}") from exc
        flds = dataclasses.fields(cls)
        required = frozenset(
            f.name
            for f in flds
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        spec = MessageSpec(
            spec_name,
            version,
            cls,
            tuple(f.name for f in flds),
            frozenset(f.name for f in flds),
            required,
            tuple(f.name for f in flds if _holds_any(hints[f.name])),
        )
        _BY_NAME[spec_name] = spec
        _BY_CLS[cls] = spec
        return cls

    return wrap


def spec_for_name(name: str) -> MessageSpec:
    spec = _BY_NAME.get(name)
    if spec is None:
        raise ProtocolError(f"unknown message type {name!r}")
    return spec


def spec_for_obj(obj: Any) -> MessageSpec | None:
    return _BY_CLS.get(type(obj))


def build(spec: MessageSpec, version: int, fields: Any, where: str = "") -> Any:
    """Validate decoded fields against `spec` and construct the record."""
    where = where or spec.name
    if version != spec.version:
        raise ProtocolError(f"{where}: schema version {version!r}, this side speaks {spec.version}")
    if not isinstance(fields, dict):
        raise ProtocolError(f"{where}: fields must be a map, got {type(fields).__name__}")
    unknown = [k for k in fields if k not in spec.names]
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown!r}; valid: {list(spec.fields)}")
    missing = spec.required - fields.keys()
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {sorted(missing)!r}")
    obj = convert(fields, spec.cls, where, ProtocolError)
    for f in spec.free_form:
        _check_depth(getattr(obj, f), f"{where}.{f}")
    return obj


def _check_depth(v: Any, path: str) -> None:
    """Free-form values nest at most MAX_DEPTH deep (iterative: no input exhausts the stack)."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, list | tuple | dict):
            if d >= MAX_DEPTH:
                raise ProtocolError(f"{path}: nested deeper than {MAX_DEPTH}")
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))


def spec_for_class(cls: type) -> MessageSpec | None:
    return _BY_CLS.get(cls)
