"""How many bytes a delta sync saves per step on the quick start (CPU; real optimizer steps), or a real checkpoint.

The quick start's config (examples/quickstart.toml: its model after the warm-up, its trainer
and optimizer settings) trains on one FSDP rank; each step's batch is synthetic (the engine
model's own samples with random rewards, trainer/synthetic.py), so the updates are real Adam
steps at the configured learning rate and schedule, not the quick start's exact rollouts.
After each step the sharded export (the bytes a sharded sync sends) is compared with the
previous one in each wire dtype: the share of words that changed, and the bytes the delta
encoding of transport/bulk/shard_delta.py would send (per bucket, the smaller of full and
sparse), against the full bytes.

Usage: python bench/sync_delta_density.py [--steps 12] [--out bench/results/sync_delta_density_cpu.json]
A real checkpoint: --config examples/smollm2_rl_cpu.toml --set model.path=DIR (SmolLM2-135M-Instruct,
converted by examples/smollm2_packaged.py; its lr 1e-6).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from miles.core.config import load_config
from miles.core.ports import group_port
from miles.core.schema import MilesConfig
from miles.models.config import ModelSpec
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch
from miles.transport.bulk.shard_delta import IDX_BYTES, encode
from miles.warmup.sft import ensure_initial_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/quickstart.toml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--set", action="append", default=[], help="config override a.b=c (e.g. model.path=...)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(group_port()))
    torch.set_num_threads(1)
    cfg = load_config(MilesConfig, a.config, a.set)
    path = ensure_initial_checkpoint(cfg)
    spec = ModelSpec.from_dir(path)
    tcfg = cfg.trainer
    tcfg.device, tcfg.world_size = "cpu", 1
    trainer = FSDPTrainer(tcfg, spec, 0, 1, init_checkpoint=path, seed=cfg.run.seed)
    engine = build_model(spec, seed=0)
    bucket = cfg.sync.bucket_mib << 20
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    prev: dict[str, torch.Tensor] = {}
    rows: list[dict[str, float]] = []
    for step in range(a.steps + 1):
        if step:
            groups = cfg.buffer.batch_groups
            trainer.train_step(engine_batch(engine, groups=groups, group_size=cfg.rollout.n_samples_per_prompt,
                                            seed=step))
        for name, dt in dtypes.items():
            buf = trainer.export_sharded_state(dt).buffer.clone()  # one rank: its shard is the model
            if step:
                word = dt.itemsize
                changed = (buf.view(torch.int32 if word == 4 else torch.int16)
                           != prev[name].view(torch.int32 if word == 4 else torch.int16)).float().mean().item()
                sent = 0
                for lo in range(0, buf.numel(), bucket):
                    hi = min(lo + bucket, buf.numel())
                    enc = encode(buf[lo:hi], prev[name][lo:hi], word)
                    sent += hi - lo if enc is None else enc.numel()
                rows.append({"step": step, "dtype": name, "changed": changed, "full_bytes": buf.numel(),
                             "delta_bytes": sent})
            prev[name] = buf
    print(f"{a.config} model ({spec.architecture}), {a.steps} Adam steps at lr {tcfg.optim.lr} "
          f"(warm-up {tcfg.optim.warmup_steps} steps), synthetic batches; bucket {cfg.sync.bucket_mib} MiB")
    print(f"{'dtype':<9} {'full bytes':>11} {'changed (median)':>17} {'delta bytes (median)':>21} {'saved':>7}")
    summary = {}
    for name in dtypes:
        rs = [r for r in rows if r["dtype"] == name]
        ch = statistics.median(r["changed"] for r in rs)
        db = statistics.median(r["delta_bytes"] for r in rs)
        full = rs[0]["full_bytes"]
        summary[name] = {"full_bytes": full, "changed_median": ch, "delta_bytes_median": db,
                         "saved_share": 1 - db / full, "break_even_density": (dtypes[name].itemsize /
                                                                             (IDX_BYTES + dtypes[name].itemsize))}
        print(f"{name:<9} {full:>11} {ch:>16.1%} {db:>21.0f} {1 - db / full:>6.1%}")
    line = json.dumps({"bench": "sync_delta_density", "config": a.config, "steps": a.steps, "summary": summary,
                       "rows": rows})
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
