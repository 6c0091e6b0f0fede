"""Weights & Biases sink in offline mode (no network): every step's scalars reach the run file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
BLOCK = 32 * 1024  # the run file is a log of records in 32 KiB blocks (a 7-byte header each)


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # block trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4: pos + 7])
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        partial += chunk
        if kind in (1, 4):  # FULL or LAST
            out.append(partial)
            partial = b""
    return out


def test_offline_run_holds_every_step(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    code = (
        "from miles.metrics.sink import MetricsSink, WandbSettings\n"
        "s = MetricsSink('.', tensorboard=False, wandb=WandbSettings('miles-test', 'offline', 'wb', "
        "{'run': {'steps': 3}}))\n"
        "for i in range(1, 4):\n"
        "    s.write({'step': i, 'rollout/reward_mean': 0.25 * i, 'note': 'text is skipped'})\n"
        "s.close()\n"
    )
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_API_KEY": "",
           "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=100, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history, config = [], {}
    for raw in _records(run_file):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind in ("config", "run"):  # the run record carries the initial config
            upd = r.config.update if kind == "config" else r.run.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in upd})
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["rollout/reward_mean"] for h in history] == [0.25, 0.5, 0.75]
    assert all("note" not in h for h in history)
    assert json.dumps(config).count('"steps": 3') == 1, config
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_launch_names_the_missing_package(tmp_path: Path) -> None:
    from miles.core.config import load_config
    from miles.core.errors import ConfigError
    from miles.core.schema import MilesConfig
    from miles.launch.validate import validate_launch

    cfg = load_config(MilesConfig, None, ["run.wandb_project=p"])
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="miles\\[wandb\\]"):
            validate_launch(cfg)
    else:
        validate_launch(cfg)  # installed: the option is accepted
