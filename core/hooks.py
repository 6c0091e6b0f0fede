"""User hooks and swappable parts: import paths checked at launch, explicit registries."""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any

from miles.core.errors import ConfigError


def resolve_import_path(path: str, where: str = "") -> Any:
    """Import 'pkg.mod:attr' (or 'pkg.mod.attr') with `pkgutil.resolve_name`; raise ConfigError naming `where`."""
    label = f" ({where})" if where else ""
    mod_name = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    if not mod_name or path.endswith((":", ".")):
        raise ConfigError(f"hook{label} {path!r} is not an import path like 'pkg.mod:func'")
    try:
        return pkgutil.resolve_name(path)
    except ValueError as exc:
        raise ConfigError(f"hook{label} {path!r} is not an import path like 'pkg.mod:func' ({exc})") from exc
    except ImportError as exc:
        raise ConfigError(f"hook{label} {path!r}: cannot import module {mod_name!r}: {exc}") from exc
    except AttributeError as exc:
        raise ConfigError(f"hook{label} {path!r}: {exc}") from exc


def resolve_hook(path: str, where: str = "") -> Callable[..., Any]:
    obj = resolve_import_path(path, where)
    if not callable(obj):
        raise ConfigError(f"hook ({where}) {path!r} is not callable")
    return obj


class Registry:
    """Maps a config `type` tag to an implementation given as an import path.

    Entries are import paths so optional heavy parts (sglang, megatron, ucxx) are
    imported only when chosen.
    """

    def __init__(self, kind: str, entries: dict[str, str]) -> None:
        self.kind = kind
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def register(self, name: str, import_path: str) -> None:
        self._entries[name] = import_path

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} type {name!r}; valid: {', '.join(self.names())}")
        return resolve_import_path(self._entries[name], f"{self.kind}.type={name}")
