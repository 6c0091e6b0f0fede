"""Test process: an engine actor on FP8 weights (the FP8 contract) over a tiny random model.

argv: --name NAME --seed S --hidden H --layers L --block B --dtype D [--run-directory | --directory ADDR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from miles.actors.engine import EngineActor
from miles.actors.runtime.host import Host
from miles.actors.runtime.process import run
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.fp8_layout import with_fp8
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--directory", default="")
    ap.add_argument("--run-directory", action="store_true")
    ap.add_argument("--name", default="e0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    spec = with_fp8(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96, hidden_size=a.hidden,
                                                  intermediate_size=2 * a.hidden, num_hidden_layers=a.layers)),
                    (a.block, a.block))

    async def setup(host: Host) -> None:
        model = build_model(spec, dtype=getattr(torch, a.dtype), seed=a.seed)
        eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=256))
        await host.add(EngineActor(eng), a.name)

    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    sys.exit(run(setup, cfg=cfg, directory=a.directory or None, run_directory=a.run_directory, ready_file=a.ready))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
