"""Typed message records: registration and precompiled field validators.

A message type is a dataclass registered with `@message`. Decoding a record
checks field names and every value's type against the dataclass hints, so a
handler only ever sees well-formed input.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

import numpy as np

from miles.core.errors import ProtocolError

MAX_DEPTH = 32
Checker = Callable[[Any, str, int], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSpec:
    name: str
    version: int
    cls: type
    fields: tuple[str, ...]
    required: frozenset[str]
    checkers: dict[str, Checker]


_BY_NAME: dict[str, MessageSpec] = {}
_BY_CLS: dict[type, MessageSpec] = {}


def message(name: str | None = None, version: int = 1) -> Callable[[type], type]:
    """Register a dataclass as a wire message type (name defaults to the class name)."""

    def wrap(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            cls = dataclasses.dataclass(cls)
        spec_name = name or cls.__name__
        if spec_name in _BY_NAME and _BY_NAME[spec_name].cls is not cls:
            raise ValueError(f"message type {spec_name!r} registered twice")
        hints = typing.get_type_hints(cls)
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
            required,
            {f.name: _checker(hints[f.name]) for f in flds},
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
    unknown = [k for k in fields if k not in spec.checkers]
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown!r}; valid: {list(spec.fields)}")
    missing = spec.required - fields.keys()
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {sorted(missing)!r}")
    kwargs = {k: spec.checkers[k](v, f"{where}.{k}", 0) for k, v in fields.items()}
    return spec.cls(**kwargs)


def _type_err(path: str, want: str, v: Any) -> ProtocolError:
    return ProtocolError(f"{path}: expected {want}, got {type(v).__name__}")


def _checker(tp: Any) -> Checker:  # noqa: C901 - one branch per supported hint shape
    origin = get_origin(tp)
    if tp is Any or tp is object:
        return _check_any
    if tp is type(None):
        def c_none(v: Any, p: str, d: int) -> Any:
            if v is not None:
                raise _type_err(p, "nil", v)
            return v
        return c_none
    if tp in (int, float, str, bool, bytes):
        return _scalar_checker(tp)
    if tp is np.ndarray:
        def c_nd(v: Any, p: str, d: int) -> Any:
            if not isinstance(v, np.ndarray):
                raise _type_err(p, "array", v)
            return v
        return c_nd
    if getattr(tp, "__module__", "").startswith("torch") and getattr(tp, "__name__", "") == "Tensor":
        def c_tensor(v: Any, p: str, d: int) -> Any:
            if type(v).__name__ != "Tensor":
                raise _type_err(p, "tensor", v)
            return v
        return c_tensor
    if dataclasses.is_dataclass(tp):
        def c_rec(v: Any, p: str, d: int) -> Any:
            if not isinstance(v, tp):
                raise _type_err(p, tp.__name__, v)
            return v
        return c_rec
    if origin is Literal:
        choices = get_args(tp)
        def c_lit(v: Any, p: str, d: int) -> Any:
            if v not in choices:
                raise ProtocolError(f"{p}: {v!r} is not one of {choices!r}")
            return v
        return c_lit
    if origin in (typing.Union, types.UnionType):
        subs = [_checker(a) for a in get_args(tp)]
        def c_union(v: Any, p: str, d: int) -> Any:
            for s in subs:
                try:
                    return s(v, p, d)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{p}: {type(v).__name__} matches none of {tp}")
        return c_union
    if origin in (list, tuple):
        args = get_args(tp)
        item = _checker(args[0]) if args else _check_any
        def c_list(v: Any, p: str, d: int) -> Any:
            if not isinstance(v, list | tuple):
                raise _type_err(p, "list", v)
            if d >= MAX_DEPTH:
                raise ProtocolError(f"{p}: nested deeper than {MAX_DEPTH}")
            return [item(x, p, d + 1) for x in v]
        return c_list
    if origin is dict:
        args = get_args(tp)
        val = _checker(args[1]) if args else _check_any
        def c_dict(v: Any, p: str, d: int) -> Any:
            if not isinstance(v, dict):
                raise _type_err(p, "map", v)
            if d >= MAX_DEPTH:
                raise ProtocolError(f"{p}: nested deeper than {MAX_DEPTH}")
            out = {}
            for k, x in v.items():
                if not isinstance(k, str | int):
                    raise ProtocolError(f"{p}: map key {k!r} is not a string or integer")
                out[k] = val(x, f"{p}.{k}", d + 1)
            return out
        return c_dict
    raise TypeError(f"unsupported message field type {tp!r}")


def _scalar_checker(tp: type) -> Checker:
    if tp is float:
        def c_float(v: Any, p: str, d: int) -> Any:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise _type_err(p, "float", v)
            return float(v)
        return c_float
    if tp is int:
        def c_int(v: Any, p: str, d: int) -> Any:
            if isinstance(v, bool) or not isinstance(v, int):
                raise _type_err(p, "int", v)
            return v
        return c_int
    if tp is bytes:
        def c_bytes(v: Any, p: str, d: int) -> Any:
            if not isinstance(v, bytes | bytearray | memoryview):
                raise _type_err(p, "bytes", v)
            return bytes(v)
        return c_bytes

    def c_exact(v: Any, p: str, d: int) -> Any:
        if not isinstance(v, tp):
            raise _type_err(p, tp.__name__, v)
        return v
    return c_exact


def _check_any(v: Any, p: str, d: int) -> Any:
    if d >= MAX_DEPTH:
        raise ProtocolError(f"{p}: nested deeper than {MAX_DEPTH}")
    if isinstance(v, list):
        for x in v:
            _check_any(x, p, d + 1)
    elif isinstance(v, dict):
        for x in v.values():
            _check_any(x, p, d + 1)
    return v


def spec_for_class(cls: type) -> MessageSpec | None:
    return _BY_CLS.get(cls)
