"""Test process: an engine actor over a tiny random model (optionally also the directory).

argv: --name NAME --seed S [--arch qwen3 --vocab 96 --hidden 64 --layers 2 --device cpu] [--run-directory | --directory ADDR | --directory-file PATH]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch

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
    ap.add_argument("--directory", default="")
    # or the file its address will be in (the directory process's ready file): wait for it here,
    # after this process's imports, so that both processes import at once
    ap.add_argument("--directory-file", default="")
    ap.add_argument("--run-directory", action="store_true")
    ap.add_argument("--name", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    if a.directory_file:
        deadline = time.monotonic() + 60
        while not os.path.exists(a.directory_file):  # written atomically, with the address in it
            if time.monotonic() > deadline:
                sys.exit(f"no directory address in {a.directory_file} after 60 s")
            time.sleep(0.02)
        a.directory = Path(a.directory_file).read_text()
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    spec = ModelSpec.from_hf(tiny_config(a.arch, vocab_size=a.vocab, hidden_size=a.hidden,
                                         intermediate_size=2 * a.hidden, num_hidden_layers=a.layers))

    async def setup(host: Host) -> None:
        for n in a.name:
            model = build_model(spec, seed=a.seed, device=a.device, dtype=getattr(torch, a.dtype))
            eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=256, device=a.device,
                                                  dtype=a.dtype))
            await host.add(EngineActor(eng), n)

    sys.exit(run(setup, cfg=cfg, directory=a.directory or None, run_directory=a.run_directory,
                 ready_file=a.ready))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump of a hung engine, for debugging
    main()
