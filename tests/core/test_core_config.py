"""Typed config: TOML + overrides, strict errors naming the dotted path, dumps, docs on every field."""

from __future__ import annotations

import json
import tomllib

import pytest

from miles.core.config import check_documented, dump_json, dump_toml, load_config
from miles.core.errors import ConfigError
from miles.core.hooks import Registry, resolve_hook
from miles.core.schema import MilesConfig


def test_defaults_overrides_and_round_trip(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[run]\nseed = 5\nname = "x"\n[transport]\nheartbeat_timeout_s = 2\n')
    cfg = load_config(MilesConfig, f, ["run.seed=7", "transport.scheme=ipc", "run.name=123"])
    assert cfg.run.seed == 7 and cfg.run.name == "123" and cfg.transport.scheme == "ipc"
    assert cfg.transport.heartbeat_timeout_s == 2.0 and isinstance(cfg.transport.heartbeat_timeout_s, float)
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg, with_docs=True))
    assert load_config(MilesConfig, again) == cfg
    assert json.loads(dump_json(cfg))["run"]["seed"] == 7
    tomllib.loads(dump_toml(cfg))


@pytest.mark.parametrize(
    "override, needle",
    [
        ("run.sed=1", "unknown config key 'run.sed'; valid keys here: name"),
        ("nope.x=1", "unknown config key 'nope'"),
        ("run.seed=abc", "run.seed: expected an integer"),
        ("transport.scheme=udp", "transport.scheme: 'udp' is not one of 'tcp', 'ipc'"),
        ("run.seed", "expected KEY=VALUE"),
        ("run.seed.x=1", "below a non-table"),
    ],
)
def test_bad_overrides_name_the_path(override, needle) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(MilesConfig, None, [override])
    assert needle in str(ei.value)


def test_the_key_value_example_is_itself_a_valid_override() -> None:
    """The error's example works as given, for `miles train` and `miles diffusion` configs."""
    from miles.diffusion.config import DiffusionConfig

    with pytest.raises(ConfigError) as ei:
        load_config(MilesConfig, None, ["run.steps"])
    example = str(ei.value).rsplit("e.g. --set ", 1)[1]
    for cls in (MilesConfig, DiffusionConfig):
        assert load_config(cls, None, [example]).run.steps == 100


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(MilesConfig, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(MilesConfig, bad)
    bad.write_text("[run]\nseed = true\n")
    with pytest.raises(ConfigError, match="run.seed"):
        load_config(MilesConfig, bad)


def test_every_option_is_documented() -> None:
    assert check_documented(MilesConfig) == []


def test_hooks_and_registry() -> None:
    assert resolve_hook("json:dumps", "t") is json.dumps
    with pytest.raises(ConfigError, match="cannot import module"):
        resolve_hook("no_such_mod:f", "buffer.filter")
    with pytest.raises(ConfigError, match="has no attribute"):
        resolve_hook("json:nope", "buffer.filter")
    reg = Registry("engine", {"a": "json:dumps"})
    assert reg.get("a") is json.dumps
    with pytest.raises(ConfigError, match="unknown engine type 'b'; valid: a"):
        reg.get("b")
