"""Trainer memory by owner, on CPU: what is alive at the peak of a launched-like RL step.

No GPU needed. The CPU allocator reports every allocation and free to torch.profiler
(`profile_memory=True`); the trace starts before the trainer is built, so every byte the trainer
holds is in it. Replaying it gives the live bytes over time, their peak, and what was alive then,
each allocation named for its owner: the master weights, the gradients, the optimizer moments
(matched by address with what the trainer holds when each phase ends), the weight-sync export
buffer, or else by the code that allocated it (FSDP2's unsharded bf16 weights and its gradient
reduce buffers, the LM head's logit chunks, activations kept for the backward, ...).

The sequence is what a launched trainer does (actors/trainer.py): train step 1 (the optimizer's
moments are created), the flat bf16 export a `cuda_ipc` push sends, train step 2 (the steady
state: moments, export buffer and all), export again. A step is `--groups` prompts of `--group`
sequences in micro-batches of `--pack` tokens (gradients accumulate over them, as a launched
step of 16 x 8 samples does), with the TIS correction on the rollout logprobs and the rest of
examples/gsm8k_qwen.toml's trainer (bf16, recompute = "full", compile off).

The model is the real Qwen2.5-Coder-0.5B shape (vocab 151,936, hidden 896, untied head; or
`--model DIR`'s config.json) with `--layers` blocks: the full 24 do not fit beside other work on
a small CPU machine. Everything the trainer holds is either per block or per vocabulary row,
so a second run with one block more gives the per-block bytes of each owner, and the ledger is
extrapolated to the real depth (`--extrapolate 24`), labelled as such. Activations follow the
pack (`--seq` tokens a sequence); on CPU the attention is the masked path, on CUDA flash
kernels: the pack-independent owners are what this ledger is for. CPU-only artefact: FSDP2's
gradient copy-in (`fsdp::chunk_cat`) has no fused CPU kernel and stages each tensor once more
(up to the largest tensor's bf16 gradient, 0.27 GB here); CUDA's kernel does not.

`--device cuda` traces the CUDA allocations instead (the caching allocator reports its blocks to
the profiler); with `--model DIR --layers <its depth>` the checkpoint's own weights, nothing
extrapolated. The launched configuration:
  --device cuda --model /root/qwen-hf --layers 24 --seq 512 --group 8 --groups 16 --pack 16384
Prints a table, then one JSON object as its last line; `--out` also writes the JSON to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9


@dataclass
class Alloc:
    ptr: int
    size: int
    t0: int
    context: tuple[str, ...]  # the enclosing profiler scopes, innermost first
    t1: int = 1 << 62  # freed at (never: alive at the end)
    freed_in: tuple[str, ...] = ()  # the scopes of the free


@dataclass
class Snapshot:
    """What the trainer holds by owner at one point: (storage address -> owner)."""

    t: int
    owners: dict[int, str] = field(default_factory=dict)


def _storage(t: Any) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    s = local.untyped_storage()
    return s.data_ptr(), s.nbytes()


def snapshot(trainer: Any, label: str) -> Snapshot:
    """The trainer's known holdings now, marked in the trace by a named profiler scope."""
    import torch
    from torch.profiler import record_function

    with record_function(f"ledger::snap::{label}"):  # the scope's start time stamps the snapshot
        pass
    snap = Snapshot(0)
    for p in trainer.trainable.parameters():
        snap.owners[_storage(p)[0]] = "master weights (fp32)"
        if p.grad is not None:
            snap.owners[_storage(p.grad)[0]] = "gradients (fp32)"
    for st in trainer.opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                snap.owners[_storage(v)[0]] = "optimizer moments (fp32)"
    w = trainer._flat_export.weights
    if w is not None:
        snap.owners[_storage(w.buffer)[0]] = "export buffer (bf16, cuda_ipc push)"
    return snap


_RULES = (  # (substring of a scope, owner): the first scope (innermost first) that matches names it
    ("ledger::export", "export (transient)"),
    ("Optimizer.step", "optimizer step (transient)"),
    ("FSDP::post_backward_reduce", "FSDP reduce buffers (fp32 grads in flight)"),
    ("FSDP::pre_backward", "FSDP unsharded weights (bf16)"),
    ("FSDP::pre_forward", "FSDP unsharded weights (bf16)"),
    ("_ChunkedHeadBackward", "LM head chunks (backward)"),
    ("_ChunkedHead", "LM head chunks (forward)"),
    ("clip_grad_norm", "grad clipping (transient)"),
)


def owner_of(a: Alloc, snaps: list[Snapshot], at: int) -> str:
    """Who holds `a` (alive at time `at`): a known holding if a snapshot taken while `a` lived
    names its address, else the code that allocated it."""
    for s in snaps:
        if a.t0 <= s.t < a.t1 and a.ptr in s.owners and s.t >= at:
            return s.owners[a.ptr]
    for s in reversed(snaps):
        if a.t0 <= s.t < a.t1 and a.ptr in s.owners:
            return s.owners[a.ptr]
    if any(s.startswith("FSDP::post_backward_reduce") for s in a.freed_in) and \
            not any(s.startswith("FSDP::post_backward_reduce") for s in a.context):
        return "bf16 unsharded gradients (until their reduce)"  # autograd's, handed to FSDP2's reduce
    for scope in a.context:
        for key, name in _RULES:
            if key in scope:
                return name
    backward = next((s for s in a.context if s.startswith("autograd::engine::evaluate_function: ")), None)
    if backward is not None:
        return "backward: " + backward.removeprefix("autograd::engine::evaluate_function: ")
    if any("ledger::build" in s for s in a.context):
        return "trainer build (other)"
    return "forward: activations and loss"


def trace(args: argparse.Namespace) -> dict[str, Any]:
    """One run at `args.layers` blocks: the ledger at the peak, per owner (bytes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import miles.trainer.sharding as sharding
    from miles.core.schema.trainer import TrainerConfig
    from miles.models.config import ModelSpec
    from miles.models.hf_io import load_model
    from miles.models.registry import build_model
    from miles.trainer.fsdp import FSDPTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer import CUDA_MODELS, _device_batch, _spec  # bench/trainer.py

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cuda = args.device == "cuda"
    weights = ""  # on CUDA at the real depth, the checkpoint's own weights (as a launched trainer loads)
    if args.model:
        hf = json.loads((Path(args.model) / "config.json").read_text())
        weights = args.model if cuda and args.layers == hf["num_hidden_layers"] else ""
        spec = ModelSpec.from_hf({**hf, "num_hidden_layers": args.layers})
    else:
        kw: dict[str, Any] = dict(CUDA_MODELS["dense_0.5b"])
        spec = _spec(str(kw.pop("arch")), **{**kw, "num_hidden_layers": args.layers})
    sharding.SINGLE_RANK_REDUCE_IN_PLACE = sharding.EMBEDDINGS_OWN_UNIT = not args.before
    cfg = TrainerConfig()  # examples/gsm8k_qwen.toml's trainer
    cfg.device = args.device
    cfg.param_dtype = "bfloat16"
    cfg.recompute = "full"
    cfg.compile = "off"
    cfg.micro_batch_tokens = args.pack or args.seq * args.group
    cfg.correction.types = ["tis"]
    cfg.optim.lr, cfg.optim.grad_clip = 2e-6, 1.0
    scorer = (load_model(weights, dtype=torch.bfloat16, device="cuda") if weights
              else build_model(spec, dtype=torch.bfloat16 if cuda else torch.float32, seed=0).to(args.device))
    batch = _device_batch(scorer, groups=args.groups, group_size=args.group, seq=args.seq)
    del scorer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    snaps: list[Snapshot] = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, profile_memory=True) as prof:
        with record_function("ledger::build"):
            t = FSDPTrainer(cfg, spec, 0, 1, init_checkpoint=weights, seed=0)
        for step in (1, 2):
            with record_function(f"ledger::step{step}"):
                t.train_step(batch)
            snaps.append(snapshot(t, f"step{step}"))
            with record_function(f"ledger::export{step}"):
                t.export_sync_state(flat=True, dtype=torch.bfloat16)
            snaps.append(snapshot(t, f"export{step}"))
        if cuda:
            torch.cuda.synchronize()
    allocs, marks, phases = _replay(prof, args.device)
    for s, mark in zip(snaps, marks, strict=True):
        s.t = mark
    live: dict[int, Alloc] = {}
    total, peak, peak_t = 0, 0, 0
    done: list[Alloc] = []
    for ev_t, ptr, size, ctx in allocs:
        if size > 0:
            live[ptr] = Alloc(ptr, size, ev_t, ctx)
            total += size
            if total > peak:
                peak, peak_t = total, ev_t
        elif ptr in live:
            a = live.pop(ptr)
            a.t1, a.freed_in = ev_t, ctx
            done.append(a)
            total -= a.size
    everything = done + list(live.values())
    at_peak = [a for a in everything if a.t0 <= peak_t < a.t1]
    by_owner: dict[str, int] = defaultdict(int)
    for a in at_peak:
        by_owner[owner_of(a, snaps, peak_t)] += a.size
    phase = next((n for n, (a, b) in phases.items() if a <= peak_t < b), "?")
    steady = [a for a in everything if a.t0 <= snaps[-1].t < a.t1]
    held: dict[str, int] = defaultdict(int)
    for a in steady:
        held[owner_of(a, snaps, snaps[-1].t)] += a.size
    gpu = {"gpu": torch.cuda.get_device_name(), "max_memory_allocated_gb": round(
        torch.cuda.max_memory_allocated() / GB, 3)} if cuda else {}
    return {"layers": args.layers, "peak": peak, "peak_phase": phase, **gpu,
            "at_peak": dict(by_owner), "held_between_steps": dict(held),
            "phase_peaks": _phase_peaks(allocs, phases)}


def _replay(prof: Any, device: str) -> tuple[list[tuple[int, int, int, tuple[str, ...]]], list[int], dict[str, tuple[int, int]]]:
    """(time, address, +size or -size, scopes) of every allocation and free in time order; the
    snapshot marks' times; each ledger phase's [start, end)."""
    out: list[tuple[int, int, int, tuple[str, ...]]] = []
    marks: list[int] = []
    phases: dict[str, tuple[int, int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name.startswith("ledger::snap"):
            marks.append(e.start_time_ns)
        elif e.name.startswith("ledger::"):
            key = e.name.removeprefix("ledger::")
            while key in phases:
                key += "'"
            phases[key] = (e.start_time_ns, e.end_time_ns)
        if type(e.extra_fields).__name__ != "_ExtraFields_Allocation" or e.extra_fields.device.type != device:
            continue
        ctx = []
        p = e.parent
        while p is not None:
            ctx.append(p.name)
            p = p.parent
        out.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, tuple(ctx)))
    out.sort(key=lambda x: (x[0], x[2] < 0))  # an allocation before a free stamped the same ns
    marks.sort()
    return out, marks, phases


def _phase_peaks(allocs: list[tuple[int, int, int, tuple[str, ...]]], phases: dict[str, tuple[int, int]]
                 ) -> dict[str, int]:
    total, sizes = 0, {}
    best: dict[str, int] = defaultdict(int)
    order = sorted(phases.items(), key=lambda kv: kv[1][0])
    for t, ptr, size, _ in allocs:
        if size > 0:
            sizes[ptr] = size
            total += size
        elif ptr in sizes:
            total -= sizes.pop(ptr)
        for name, (a, b) in order:
            if a <= t < b:
                best[name] = max(best[name], total)
    return dict(best)


def extrapolate(runs: list[dict[str, Any]], depth: int) -> dict[str, float]:
    """Per-owner bytes at `depth` blocks from runs at two depths (linear in the block count)."""
    lo, hi = sorted(runs, key=lambda r: r["layers"])[:2]
    dl = hi["layers"] - lo["layers"]
    out = {}
    for k in set(lo["at_peak"]) | set(hi["at_peak"]):
        a, b = lo["at_peak"].get(k, 0), hi["at_peak"].get(k, 0)
        out[k] = b + (b - a) / dl * (depth - hi["layers"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF directory whose config.json gives the shape (default: "
                    "bench/trainer.py's dense_0.5b, the Qwen2.5-0.5B shape, untied head)")
    ap.add_argument("--layers", default="1,2", help="block counts to trace (two: extrapolated to --extrapolate)")
    ap.add_argument("--extrapolate", type=int, default=24, help="the real model's block count")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the same ledger of CUDA allocations (run it at the real depth: --layers 24)")
    ap.add_argument("--seq", type=int, default=8, help="tokens per sequence")
    ap.add_argument("--group", type=int, default=2, help="sequences per prompt")
    ap.add_argument("--groups", type=int, default=2, help="prompts per step")
    ap.add_argument("--pack", type=int, default=0, help="micro-batch tokens (default: one group; gradients "
                    "accumulate over the step's micro-batches)")
    ap.add_argument("--before", action="store_true", help="the previous layout: FSDP2's own reduce buffers, the embeddings in the root unit")
    ap.add_argument("--out", default="")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child: one depth
    a = ap.parse_args()
    if a.one:
        a.layers = a.one
        print(json.dumps(trace(a)))
        return
    runs = []
    for n in [int(x) for x in a.layers.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(n), "--seq", str(a.seq), "--group", str(a.group),
               "--groups", str(a.groups), "--pack", str(a.pack), "--model", a.model, "--device", a.device
               ] + (["--before"] if a.before else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if p.returncode:
            sys.exit(f"depth {n} failed:\n{p.stderr[-3000:]}")
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    deep = extrapolate(runs, a.extrapolate) if len(runs) >= 2 else {}
    owners = sorted({k for r in runs for k in r["at_peak"]} | set(deep), key=lambda k: -deep.get(k, 0))
    head = "".join(f"{'L=' + str(r['layers']):>10s}" for r in runs) + (f"{'L=' + str(a.extrapolate) + '*':>10s}"
                                                                      if deep else "")
    print(f"alive at the peak, GB ({'before' if a.before else 'after'}; * = extrapolated)")
    print(f"{'owner':48s}{head}")
    for k in owners:
        if max([r["at_peak"].get(k, 0) for r in runs] + [deep.get(k, 0)]) < GB / 2000:
            continue  # under 0.5 MB everywhere
        cells = "".join(f"{r['at_peak'].get(k, 0) / GB:10.3f}" for r in runs)
        print(f"{k:48s}{cells}" + (f"{deep.get(k, 0) / GB:10.3f}" if deep else ""))
    tot = "".join(f"{r['peak'] / GB:10.3f}" for r in runs)
    print(f"{'PEAK':48s}{tot}" + (f"{sum(deep.values()) / GB:10.3f}" if deep else ""))
    print("peak in: " + ", ".join(f"L={r['layers']}: {r['peak_phase']}" for r in runs))
    out = {"shape": a.model or "dense_0.5b (Qwen2.5-0.5B, untied)", "before": a.before, "seq": a.seq,
           "group": a.group, "groups": a.groups, "pack": a.pack or a.seq * a.group, "device": a.device,
           "runs": [{**r, "at_peak_gb": {k: round(v / GB, 4) for k, v in r["at_peak"].items()},
                     "held_between_steps_gb": {k: round(v / GB, 4) for k, v in r["held_between_steps"].items()},
                     "phase_peaks_gb": {k: round(v / GB, 4) for k, v in r["phase_peaks"].items()},
                     "peak_gb": round(r["peak"] / GB, 4)} for r in runs]}
    for r in out["runs"]:
        for k in ("at_peak", "held_between_steps", "phase_peaks", "peak"):
            r.pop(k)
    if deep:
        out[f"extrapolated_L{a.extrapolate}_gb"] = {k: round(v / GB, 4) for k, v in deep.items()}
        out[f"extrapolated_L{a.extrapolate}_peak_gb"] = round(sum(deep.values()) / GB, 3)
    line = json.dumps(out)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
