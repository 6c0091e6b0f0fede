"""Group filters: `(group) -> (keep, reason)`; a dropped reason becomes the metric
`rollout/dynamic_filter/drop_<reason>`. A user filter is any function of that
shape named by import path (`buffer.filter_fn`)."""

from __future__ import annotations

from collections.abc import Callable

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.rollout.types import Group

FilterFn = Callable[[Group], tuple[bool, str]]


def dynamic_sampling(group: Group) -> tuple[bool, str]:
    """Drop groups whose rewards all agree (zero advantage → no gradient): reason 'zero_std'."""
    rewards = [r for r in group.rewards if r is not None]
    if len(rewards) >= 1 and max(rewards) - min(rewards) == 0.0:
        return False, "zero_std"
    return True, ""


def keep_all(group: Group) -> tuple[bool, str]:
    return True, ""


def check_verdict(v: object, where: str) -> tuple[bool, str]:
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], bool) and isinstance(v[1], str)):
        raise ConfigError(f"{where}: a filter must return (keep: bool, reason: str), got {v!r}")
    keep, reason = v
    if not keep and not reason.replace("_", "").isalnum():
        raise ConfigError(f"{where}: drop reason {reason!r} must be a non-empty word (it names a metric)")
    return keep, reason


def load_filter(path: str) -> FilterFn:
    """Resolve `buffer.filter_fn`; empty means keep everything."""
    return resolve_hook(path, "buffer.filter_fn") if path else keep_all
