"""Every 'auto' is resolved in core/schema: the config-only ones when the config is loaded, the
trainer's machine-dependent ones (core/schema/runtime.py) from the facts of the process that
trains; after both, no value of the config is 'auto', and a role loading the dump gets it as is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from miles.core.config import dump_json, from_dict, load_config
from miles.core.errors import ConfigError, EngineError
from miles.core.schema import MilesConfig
from miles.core.schema.rollout import resolve_render_mode
from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
from miles.core.schema.sync import SyncConfig, pause_mode_for
from miles.core.schema.trainer import TrainerConfig

pytestmark = pytest.mark.timeout(60)

# what only the process that trains can resolve: it depends on the device it sees
MACHINE = {"trainer.device", "trainer.param_dtype", "trainer.optim.impl", "trainer.compile",
           "trainer.packed_attention"}
# the rollout process resolves render_mode with the tokenizer it loads; the sync channel's own
# properties (SyncConfig.flat, catchup_from_buffer) resolve these per channel, whose transport a
# derived channel changes (the snapshot engine's is zmq)
PROCESS = {"rollout.render_mode", "sync.flat_export", "sync.catchup_source"}


def autos(node: Any, path: str = "") -> set[str]:
    """Dotted paths of the values that are 'auto' in a dumped config."""
    if isinstance(node, dict):
        return {p for k, v in node.items() for p in autos(v, f"{path}.{k}" if path else k)}
    return {path} if node == "auto" else set()


def test_loading_resolves_every_auto_but_the_machines() -> None:
    cfg = load_config(MilesConfig, None, ["engine.type=sglang", "engine.sglang_url=http://127.0.0.1:1"])
    assert autos(json.loads(dump_json(cfg))) == MACHINE | PROCESS
    assert cfg.run.log_json == "file" and cfg.run.json_logs is None
    assert cfg.sync.pause_mode == "retract" and cfg.engine.sglang_weight_update == "disk"
    assert cfg.trainer.correction.old_logprobs_pass == "when_needed"
    lz4 = importlib.util.find_spec("lz4") is not None
    assert cfg.sync.delta_compression == ("lz4_sampled" if lz4 else "zlib_sampled")
    te = importlib.util.find_spec("transformer_engine") is not None
    assert cfg.trainer.megatron.transformer_impl == ("transformer_engine" if te else "local")
    on_gpu = load_config(MilesConfig, None, ["engine.type=sglang", "engine.device=cuda",
                                             "engine.sglang_url=http://127.0.0.1:1"])
    assert on_gpu.engine.sglang_weight_update == "tensor"


@pytest.mark.parametrize(("cuda", "moe", "want"), [
    (False, False, ("cpu", "float32", "single", "off", "masked")),
    (True, False, ("cuda", "bfloat16", "fused", "try", "by_length")),
    (True, True, ("cuda", "bfloat16", "fused", "off", "by_length")),
])
def test_the_trainer_resolves_from_its_facts(cuda: bool, moe: bool, want: tuple[str, ...]) -> None:
    cfg = load_config(MilesConfig, None, [])
    cfg.trainer = resolve_trainer(cfg.trainer, RuntimeFacts(cuda=cuda), moe=moe)
    tr = cfg.trainer
    assert (tr.device, tr.param_dtype, tr.optim.impl, tr.compile, tr.packed_attention) == want
    dumped = json.loads(dump_json(cfg))
    assert autos(dumped) == PROCESS
    again = from_dict(MilesConfig, dumped)  # a role loading the launcher's dump
    assert again == cfg
    # a value resolved at launch reaches a role on another machine unchanged
    assert resolve_trainer(again.trainer, RuntimeFacts(cuda=not cuda), moe=moe) == tr


def test_explicit_values_are_kept_and_megatron_trains_on_cuda() -> None:
    tr = TrainerConfig(device="cpu", compile="on", packed_attention="varlen")
    got = resolve_trainer(tr, RuntimeFacts(cuda=True), moe=False)
    assert (got.device, got.param_dtype, got.compile, got.packed_attention) == ("cpu", "float32", "on", "varlen")
    meg = resolve_trainer(TrainerConfig(backend="megatron"), RuntimeFacts(cuda=False), moe=False)
    assert meg.device == "cuda"
    assert TrainerConfig(compile="on").compile == "on" and TrainerConfig().compile == "auto"


def test_pause_and_render_mode_resolve_in_one_place() -> None:
    assert pause_mode_for("auto", "retract") == "retract" and pause_mode_for("abort", "in_place") == "abort"
    with pytest.raises(EngineError, match="pause mode 'none'"):
        pause_mode_for("none", "in_place")  # the engine is not asked to pause at all then
    asked: list[bool] = []

    def local_ok() -> bool:
        asked.append(True)
        return True

    assert resolve_render_mode("full", local_ok) == "full" and not asked  # the check runs only for auto
    assert resolve_render_mode("auto", local_ok) == "local" and asked
    assert resolve_render_mode("auto", lambda: False) == "full"
    assert SyncConfig(delta_compression="zlib").delta_compression == "zlib"


def test_config_only_rules_refuse_at_load() -> None:
    # was a launch check (launch/validate.py); it needs nothing but the config
    with pytest.raises(ConfigError, match="trainer.pause_engines"):
        load_config(MilesConfig, None, ["trainer.pause_engines=true", "engine.type=sglang",
                                        "engine.sglang_url=http://127.0.0.1:1"])


def test_trainer_rank_0_records_its_resolution_in_a_launched_run_dir(tmp_path: Path) -> None:
    from miles.metrics.run_dir import record_trainer, write_config

    cfg = load_config(MilesConfig, None, [f"run.dir={tmp_path}"])
    resolved = resolve_trainer(cfg.trainer, RuntimeFacts(cuda=False), moe=False)
    assert record_trainer(cfg, resolved, write=True).trainer == resolved
    assert not (tmp_path / "config.resolved.json").exists()  # not a launched run: nothing written
    write_config(tmp_path, cfg)  # what the launcher writes
    assert record_trainer(cfg, resolved, write=False).trainer == resolved  # other ranks: no write
    assert autos(json.loads((tmp_path / "config.resolved.json").read_text())) == MACHINE | PROCESS
    record_trainer(cfg, resolved, write=True)
    dumped = json.loads((tmp_path / "config.resolved.json").read_text())
    assert autos(dumped) == PROCESS and dumped["trainer"]["device"] == "cpu"
    assert 'compile = "off"' in (tmp_path / "config.resolved.toml").read_text()
    assert from_dict(MilesConfig, dumped).trainer == resolved  # what --resume loads
