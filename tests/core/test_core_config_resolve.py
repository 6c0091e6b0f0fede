"""The config is resolved and checked once, when it is loaded (core/schema/resolve.py): the
values other parts need in another form are derived there, rules across sections refuse a
config there, and a role that loads the launcher's dump gets the same config."""

from __future__ import annotations

import json

import pytest

from miles.core.config import dump_json, dump_toml, from_dict, load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig

pytestmark = pytest.mark.timeout(60)


def load(*sets: str) -> MilesConfig:
    return load_config(MilesConfig, None, list(sets))


def test_channels_are_derived_at_load() -> None:
    cfg = load()
    assert cfg.channel_sync == cfg.sync and cfg.sync.dtype == "float32"  # 'engine' -> the torch engine's
    assert (cfg.snapshot_sync.transport, cfg.snapshot_sync.pause_mode) == ("zmq", "none")
    fp8 = load("model.fp8=blockwise", "sync.transport=broadcast")
    # the publisher casts to sync.dtype and quantizes; the channel moves its codes as given
    assert fp8.sync.dtype == "float32" and fp8.sync.flat
    assert (fp8.channel_sync.dtype, fp8.channel_sync.flat_export, fp8.channel_sync.transport) == \
        ("same", "off", "broadcast")
    assert (fp8.snapshot_sync.dtype, fp8.snapshot_sync.transport) == ("same", "zmq")


def test_derived_values_are_not_keys() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'channel_sync'"):
        load("channel_sync.dtype=same")
    cfg = load("model.fp8=blockwise")
    assert "channel_sync" not in dump_toml(cfg) and "snapshot_sync" not in json.loads(dump_json(cfg))


def test_a_role_loading_the_dump_gets_the_same_config() -> None:
    cfg = load("engine.type=sglang", "model.fp8=off", "eval.mode=snapshot")
    again = from_dict(MilesConfig, json.loads(dump_json(cfg)))
    assert again == cfg
    assert (again.sync.pause_mode, again.engine.sglang_mem_fraction) == ("retract", cfg.engine.sglang_mem_fraction)
    assert again.channel_sync == cfg.channel_sync and again.snapshot_sync == cfg.snapshot_sync


@pytest.mark.parametrize("sets, match", [
    (["trainer.true_on_policy=true"], "engine.batch_invariant"),
    (["run.time_limit_s=10", "trainer.world_size=2"], "run.time_limit_s"),
    (["run.time_limit_s=-1"], "run.time_limit_s"),
    (["eval.mode=external"], "eval.command"),
    (["eval.mode=shared", "eval.every_steps=0"], "eval.every_steps"),
    (["eval.samples=-1"], "eval.samples"),
    (["engine.mps_thread_percent=101"], "engine.mps_thread_percent"),
    (["sync.sharded=true", "eval.mode=snapshot"], "sync.sharded"),
    (["trainer.lora.rank=4", "sync.sharded=true"], "trainer.lora.rank"),
    (["trainer.optim.betas=[0.9, 1.0]"], "trainer.optim.betas"),
    (["trainer.optim.lr=1e-6", "trainer.optim.min_lr=1e-5"], "min_lr"),
    (["trainer.backend=megatron", "trainer.device=cpu"], "trainer.device"),
    (["trainer.backend=megatron", "trainer.recompute=mlp"], "trainer.recompute"),
    (["trainer.micro_batch_tokens=0"], "trainer.micro_batch_tokens"),
    (["trainer.temperature=0"], "trainer.temperature"),
    (["trainer.loss.eps_clip_low=-0.1"], "eps_clip_low"),
])
def test_a_bad_config_is_refused_at_load_naming_the_option(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(*sets)
