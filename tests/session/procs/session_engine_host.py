"""Test process: one engine actor over a tiny random model, registered with a given directory.

argv: --directory ADDR --name NAME [--vocab 128 --seed 0] --ready FILE
"""

from __future__ import annotations

import argparse
import os
import sys

from miles.actors.engine import EngineActor
from miles.actors.runtime.host import Host
from miles.actors.runtime.process import run
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--directory", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=a.vocab))

    async def setup(host: Host) -> None:
        engine = TorchEngine(build_model(spec, seed=a.seed), EngineConfig(max_batch_size=8, max_seq_len=1024))
        await host.add(EngineActor(engine), a.name)

    sys.exit(run(setup, cfg=cfg, directory=a.directory, ready_file=a.ready))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
