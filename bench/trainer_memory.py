"""Trainer peak memory of a real model: where the GPU memory of one RL step goes, and what brings it down.

Each case runs in its own process (a clean peak): FSDPTrainer on one GPU with the model of
`--model` (an HF directory, e.g. Qwen2.5-Coder-0.5B-Instruct from `miles fetch-model`), or the
`dense_0.5b` shape of bench/trainer.py with random weights when none is given; a batch of
sequences of `--seq` tokens (a quarter prompt) filling `--pack` tokens, scored by the model itself
(rollout logprobs); two train steps; `torch.cuda.max_memory_allocated` over both, and the median
step time. Cases (`--cases`, comma-separated):
  bf16_16k_before   bf16, 16k packs, no recompute, the head keeping all logits (the old defaults:
                    SAVE_LOGITS_BYTES 8 GiB, CHUNK_ELEMS 2^28)
  bf16_16k_head     bf16, 16k packs, no recompute, today's head (logits recomputed in chunks)
  bf16_16k          bf16, 16k packs, recompute=full, today's head  (goal: <= 12 GB)
  fp32_8k_before    fp32, 8k packs, no recompute, old head
  fp32_8k           fp32, 8k packs, recompute=full, today's head (goal: runs on an 80 GB card)
  fp32_8k_masked    fp32_8k with packs of 8,000 tokens (8 x 1,000), as a launched run's packs fall
                    short of the budget: under 8,192 tokens packed_attention 'by_length' takes the
                    masked path, a [7 x T, T] fp32 bias (1.8 GB at T = 8,000) instead of varlen
  launched_16k      what a launched examples/gsm8k_qwen.toml trainer does (H100, session 16: 14.97 GB):
                    bf16, 16k packs, recompute=full, compile off, the TIS correction, `--packs`
                    micro-batches a step (gradients accumulate over them), and after every step the
                    flat bf16 export a cuda_ipc push sends (the persistent export buffer);
                    `--steps` steps (step 1 creates the optimizer moments). Goal: <= 12 GB
  launched_16k_before  the same with the previous layout: FSDP2's own one-rank gradient reduce
                    (two fp32 buffers per unit) and the embeddings in the root unit
                    (trainer/sharding.py SINGLE_RANK_REDUCE_IN_PLACE = EMBEDDINGS_OWN_UNIT = False)
  launched_8k, launched_8k_before  the same at 8k packs
  launched_16k_streamed  launched_16k with the opt-in trainer.memory.optimizer = "streamed" (the
                    AdamW moments on disk, streamed through one bucket: what <= 12 GB costs in time)
Launched cases also report `held_gb` (allocated between steps: what the trainer keeps) and
`export_gb` (the export buffer). The last line is one JSON object; `--out` also writes it to a file.
For the launched configuration: `--model /root/qwen-hf --seq 512 --packs 4 --steps 3`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "bf16_16k_before": dict(dtype="bfloat16", pack=16384, recompute="off", old_head=True),
    "bf16_16k_head": dict(dtype="bfloat16", pack=16384, recompute="off", old_head=False),
    "bf16_16k": dict(dtype="bfloat16", pack=16384, recompute="full", old_head=False),
    "fp32_8k_before": dict(dtype="float32", pack=8192, recompute="off", old_head=True),
    "fp32_8k": dict(dtype="float32", pack=8192, recompute="full", old_head=False),
    "fp32_8k_masked": dict(dtype="float32", pack=8192, recompute="full", old_head=False, seq=1000),
    "launched_16k": dict(dtype="bfloat16", pack=16384, recompute="full", old_head=False, launched=True),
    "launched_16k_before": dict(dtype="bfloat16", pack=16384, recompute="full", old_head=False, launched=True,
                                before=True),
    "launched_16k_streamed": dict(dtype="bfloat16", pack=16384, recompute="full", old_head=False, launched=True,
                                  streamed=True),
    "launched_8k": dict(dtype="bfloat16", pack=8192, recompute="full", old_head=False, launched=True),
    "launched_8k_before": dict(dtype="bfloat16", pack=8192, recompute="full", old_head=False, launched=True,
                               before=True),
}


def run_case(name: str, model: str, seq: int, steps: int, packs: int) -> dict[str, float | str]:
    import torch

    import miles.models.chunked_logprobs as ch
    import miles.trainer.sharding as sharding
    from miles.core.schema.trainer import TrainerConfig
    from miles.models.config import ModelSpec
    from miles.models.hf_io import load_model
    from miles.models.registry import build_model
    from miles.trainer.fsdp import FSDPTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer import CUDA_MODELS, _device_batch, _spec  # bench/trainer.py (bench/ on sys.path)

    c = CASES[name]
    seq = int(c.get("seq", seq))  # type: ignore[call-overload]
    launched = bool(c.get("launched"))
    sharding.SINGLE_RANK_REDUCE_IN_PLACE = sharding.EMBEDDINGS_OWN_UNIT = not c.get("before")
    if c["old_head"]:
        ch.SAVE_LOGITS_BYTES, ch.CHUNK_ELEMS = 8 << 30, 1 << 28
    if model:
        spec = ModelSpec.from_dir(model)
        scorer = load_model(model, dtype=torch.bfloat16, device="cuda")
    else:
        spec = _spec(**CUDA_MODELS["dense_0.5b"])  # type: ignore[arg-type]
        scorer = build_model(spec, dtype=torch.bfloat16, seed=0).cuda()
    group = 8 if launched else 4  # launched: 8 samples a prompt
    tokens = 16384 * packs if launched else c["pack"]  # launched: one batch (16 prompts x 8), any pack size
    batch = _device_batch(scorer, groups=max(1, tokens // (seq * group)), group_size=group, seq=seq)
    del scorer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cfg = TrainerConfig()
    cfg.device = "cuda"
    cfg.param_dtype = c["dtype"]  # type: ignore[assignment]
    cfg.micro_batch_tokens = c["pack"]
    cfg.recompute = c["recompute"]  # type: ignore[assignment]
    cfg.optim.lr = 1e-6
    if launched:  # examples/gsm8k_qwen.toml's trainer
        cfg.compile = "off"
        cfg.correction.types = ["tis"]
        cfg.optim.lr, cfg.optim.grad_clip = 2e-6, 1.0
        if c.get("streamed"):
            cfg.memory.optimizer = "streamed"
    t = FSDPTrainer(cfg, spec, 0, 1, init_checkpoint=model, seed=0)
    times = []
    held = export = 0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = t.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if launched:  # the publisher's export for a cuda_ipc push: flat, in the engine's bf16
            w = t.export_sync_state(flat=True, dtype=torch.bfloat16)
            export = w.buffer.numel() * w.buffer.element_size()  # type: ignore[union-attr]
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    extra = {"held_gb": round(held / 1e9, 2), "export_gb": round(export / 1e9, 2)} if launched else {}
    return {"case": name, "peak_gb": round(peak / 1e9, 2), **extra,
            "reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
            "step_s": round(statistics.median(times[1:] or times), 3),
            "tokens": batch.num_tokens, "skipped_nonfinite": m["train/skipped_nonfinite"],
            "gpu": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF directory of the model (default: random dense_0.5b shape)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--packs", type=int, default=4, help="launched cases: micro-batches a step")
    ap.add_argument("--out", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child process: run one case
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_case(a.one, a.model, a.seq, a.steps, a.packs)))
        return
    rows = []
    for name in a.cases.split(","):
        p = subprocess.run([sys.executable, __file__, "--one", name, "--model", a.model, "--seq", str(a.seq),
                            "--steps", str(a.steps), "--packs", str(a.packs)], capture_output=True, text=True, env=os.environ)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            rows.append(json.loads(last))
        except json.JSONDecodeError:
            err = (p.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"case": name, "error": err[-300:]})
    print(f"{'case':22s} {'peak GB':>8s} {'reserved':>8s} {'held':>6s} {'export':>6s} {'step s':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22s} ERROR {r['error']}")
        else:
            print(f"{r['case']:22s} {r['peak_gb']:8.2f} {r['reserved_gb']:8.2f} {r.get('held_gb', 0):6.2f} "
                  f"{r.get('export_gb', 0):6.2f} {r['step_s']:7.3f}")
    out = {"model": a.model or "random dense_0.5b", "seq": a.seq, "packs": a.packs, "steps": a.steps,
           **{f"{r['case']}_{k}": v for r in rows for k, v in r.items() if k != "case"}}
    line = json.dumps(out)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
