"""Disaggregated fully_async vs sync: the engine on GPU 1, the trainer on GPU 0, same workload.

Full `miles train` runs through the local launcher (engine, rollout and trainer role
processes over ZeroMQ), configured as bench/async_vs_sync.py's real part (quick-start
model, long-tailed log-normal response lengths, 8 groups x 4 a step, staleness bound 2),
with engine.device = cuda:1 and trainer.device = cuda (rank 0 -> GPU 0). Throughput =
response tokens trained on / step time over every step after the first.

Usage: python bench/multi_gpu/disagg_async.py --device cuda --steps 6 --out r.json   (last line: JSON)
       --device cpu: both roles on the CPU (a smoke run of the same path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from async_vs_sync import launch_and_read, real_config  # noqa: E402

from miles.core.logging import configure_logging  # noqa: E402
from miles.launch.local import LocalLauncher  # noqa: E402

RUNS = [("sync", "sync", False), ("fully_async+admission", "fully_async", True)]


def run(root: Path, name: str, mode: str, admission: bool, steps: int, device: str, transport: str) -> dict[str, Any]:
    cfg = real_config(root / name, mode, admission, steps)
    if transport:
        cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, transport=transport))
    eng_dev, tr_dev = ("cuda:1", "cuda") if device == "cuda" else ("cpu", "cpu")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, device=eng_dev),
                              trainer=dataclasses.replace(cfg.trainer, device=tr_dev))
    rows, wall = launch_and_read(cfg, LocalLauncher, name)
    timed = rows[1:]  # step 1 fills the pipeline and pays start-up
    tokens = sum(r["rollout/trained_response_tokens"] for r in timed)
    seconds = sum(r["perf/step_time_s"] for r in timed)
    return {"steps": len(rows), "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
            "wall_s": round(wall, 1), "engine_device": cfg.engine.device, "trainer_device": cfg.trainer.device}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="disagg_async.json")
    ap.add_argument("--transport", default="", help="sync.transport; default: broadcast on cuda (the zmq "
                    "control wire refuses CUDA tensors), the config's own on cpu")
    a = ap.parse_args()
    if not a.transport and a.device == "cuda":
        a.transport = "broadcast"
    configure_logging("error", None, run="bench", role="launcher")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-disagg-") as tmp:
        for i, (name, mode, adm) in enumerate(RUNS):
            out[name] = run(Path(tmp), f"run{i}", mode, adm, a.steps, a.device, a.transport)
    ratio = out["fully_async+admission"]["tok_s"] / out["sync"]["tok_s"]
    note = ("few steps: fully_async's later steps draw on rollouts buffered while step 1 trained, so a short "
            "run overstates the steady-state ratio" if a.steps < 20 else "")
    print(f"{'run':24s} {'trained tok/s':>13s} {'steps':>5s} {'wall s':>7s}")
    for k, v in out.items():
        print(f"{k:24s} {v['tok_s']:13.1f} {v['steps']:5d} {v['wall_s']:7.1f}")
    print(f"fully_async / sync throughput: {ratio:.2f}x")
    result = {"bench": "disagg_async", "device": a.device, "workload": "bench/async_vs_sync.py real part "
              "(quick-start model, long-tailed lengths)", "sync_transport": a.transport or "config default", "runs": out, "ratio_async_vs_sync": round(ratio, 3), "note": note}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
