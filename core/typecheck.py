"""One set of type rules for config values and wire records, kept by msgspec.

`convert(value, type, path, error)` checks a value against a type hint (scalars, str
/ bytes, Literal, unions, lists, dicts, dataclasses, numpy arrays and tensors as
instances) and returns it converted the same way everywhere: int is accepted for
float, bool never for int, bytes-likes become bytes. A mismatch raises `error`
naming the dotted path and what was expected. config.py (`_coerce`) and
transport/schema.py (`build`) both go through here.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin

import msgspec

from miles.core.errors import MilesError

_WANT = {"int": "an integer", "float": "a number", "bool": "true/false", "str": "a string",
         "bytes": "bytes", "array": "a list", "object": "a table (map)", "null": "nothing (null)"}
_EXPECTED = re.compile(r"^Expected `([^`]+)`, got `([^`]+)`$")
_ENUM = re.compile(r"^Invalid enum value (.+)$")
_AT = re.compile(r" - at `(?:\$([^`]*)|key)`(?: in `\$([^`]*)`)?$")


def _instance(tp: type, obj: Any) -> Any:
    """Custom types (numpy arrays, torch tensors, records): an instance passes as it is."""
    if isinstance(obj, tp):
        return obj
    raise msgspec.ValidationError(f"Expected `{tp.__name__}`, got `{type(obj).__name__}`")


def _words(msg: str, tp: Any, value: Any) -> str:
    m = _EXPECTED.match(msg)
    if m:
        want = " | ".join(_WANT.get(w.strip(), w.strip()) for w in m.group(1).split("|"))
        return f"expected {want}, got {m.group(2)}"
    bad = _ENUM.match(msg)
    choices = _literals(tp)
    if bad and choices:  # also inside list[Literal[...]] / dict[str, Literal[...]] / optionals
        return f"{bad.group(1)} is not one of {', '.join(map(repr, choices))}"
    return msg[:1].lower() + msg[1:]


def _literals(tp: Any) -> tuple[Any, ...]:
    """The choices of the first Literal in a type hint (itself or an element type)."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    for arg in get_args(tp):
        found = _literals(arg)
        if found:
            return found
    return ()


def convert(value: Any, tp: Any, path: str, error: type[MilesError]) -> Any:
    """`value` checked against `tp` and converted; raises `error` naming `path` on a mismatch."""
    try:
        return msgspec.convert(value, tp, strict=True, dec_hook=_instance)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        where = path
        at = _AT.search(msg)
        if at:
            msg = msg[: at.start()]
            inner, outer = at.group(1), at.group(2)
            # "$.x[1]": a position inside the value; "`key` in `$.d`": a bad key of the map at $.d
            where = f"{path}{inner}" if outer is None else f"{path}{outer} (a key)"
        raise error(f"{where}: {_words(msg, tp, value)}") from None
    except (TypeError, ValueError) as exc:  # a hint msgspec cannot check (a schema bug, not bad input)
        raise error(f"{path}: cannot check type {tp!r}: {exc}") from None
