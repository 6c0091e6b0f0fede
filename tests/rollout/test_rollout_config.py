"""RolloutConfig / BufferConfig: documented fields, strict loading, builders."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.core.config import check_documented, dump_toml, load_config
from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.rollout.buffer import RolloutBuffer
from miles.rollout.filters import dynamic_sampling
from miles.rollout.layers import load_layer
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer


def test_every_field_documented_and_round_trips(tmp_path: Path) -> None:
    assert check_documented(MilesConfig) == []
    cfg = load_config(MilesConfig, overrides=["buffer.capacity=4", "rollout.session_policy=branching",
                                              "rollout.env_args={seed = 3}"])
    p = tmp_path / "c.toml"
    p.write_text(dump_toml(cfg, with_docs=True))
    back = load_config(MilesConfig, p)
    assert back.buffer.capacity == 4 and back.rollout.env_args == {"seed": 3}
    assert back.rollout.session_policy == "branching"


def test_bad_values_are_named() -> None:
    with pytest.raises(ConfigError, match="rollout.match_policy"):
        load_config(MilesConfig, overrides=["rollout.match_policy=fuzzy"])
    with pytest.raises(ConfigError, match="capacity must be >= 1"):
        load_config(MilesConfig, overrides=["buffer.capacity=0"])
    with pytest.raises(ConfigError, match="admission_control needs max_staleness"):
        load_config(MilesConfig, overrides=["buffer.admission_control=true", "buffer.max_staleness=-1"])


def test_builders_from_config(tmp_path: Path) -> None:
    cfg = load_config(MilesConfig, overrides=["buffer.filter_fn=miles.rollout.filters:dynamic_sampling",
                                              "buffer.max_staleness=-1", "rollout.session_policy=branching"])
    buf = RolloutBuffer.from_config(cfg.buffer, cfg.rollout.n_samples_per_prompt)
    assert buf.filter_fn is dynamic_sampling and buf.max_staleness is None
    store = SessionStore.from_config(cfg.rollout, tiny_tokenizer(tmp_path))
    assert store.policy == "branching" and store.reasoning_tags == ("<think>", "</think>")
    env = resolve_hook(cfg.rollout.env, "rollout.env")(**cfg.rollout.env_args)
    for kind in ("rollout", "generate"):
        load_layer(kind, getattr(cfg.rollout, f"{kind}_fn"))
    load_layer("agent", cfg.rollout.agent_fn or env.agent)
