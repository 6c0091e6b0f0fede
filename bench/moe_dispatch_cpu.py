"""Benchmark: the CPU MoE experts' dispatch in the engine's inference, by token count.

Per token count N (a decode step's batch, or a prefill chunk), each way of computing the routed
experts of one MoE layer on random routing (top-k distinct experts per token, as the router picks):

  dense     every expert on every token, unselected ones weighted 0 (`Experts._dense`: 1 GEMM,
            1 batched GEMM; 4x the selected multiply-adds at top-4 of 16)
  loop      only the selected: tokens sorted by expert, a GEMM pair per active expert
            (`Experts._grouped`)
  gmm       only the selected through torch._grouped_mm (its CPU kernel: a C++ loop of GEMMs;
            the path transformers 5 takes on CPU): models/moe_cpu.selected_experts
  pick      which of dense / gmm the engine's CPU dispatch takes (models/moe_cpu.prefer_dense)
  sampled   only the selected gate/up products through torch.sparse.sampled_addmm (one SDDMM
            over the selected (token, expert) blocks), then the dense down projection: the
            one single-call way found to skip the unselected gate/up work without copying
            expert weights (a candidate measured here, not a path of models/moe.py)

Times are the process's CPU time per call (median of interleaved rounds, one thread), with the
weights hot in cache (the layer called back to back), so they show each way's compute and its
per-op cost; in the engine every layer's weights are cold again by its next step.
Shapes (`--shapes`): `tiny`, bench/engine.py's CPU MoE model (16 experts top-4, hidden 128, expert
inter 64); `mid`, 64 experts top-8, hidden 512, inter 128. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from miles.models.moe import Experts
from miles.models.moe_cpu import prefer_dense, selected_experts

SHAPES = {"tiny": (16, 4, 128, 64), "mid": (64, 8, 512, 128)}  # experts, top_k, hidden, inter


def sampled(ex: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The selected gate/up blocks as one SDDMM (CSR pattern: each token's k experts' 2I
    columns, sorted), the down projection dense on the scattered activations."""
    n, k = ids.shape
    e, two_i, h = ex.gate_up_proj.shape
    i = ex.inter
    sid, order = ids.sort(dim=1)
    cols = (sid.unsqueeze(-1) * two_i + torch.arange(two_i)).reshape(-1)
    crow = torch.arange(0, n * k * two_i + 1, k * two_i)
    pattern = torch.sparse_csr_tensor(crow, cols, torch.empty(n * k * two_i), size=(n, e * two_i))
    gu = torch.sparse.sampled_addmm(pattern, x, ex.gate_up_proj.reshape(e * two_i, h).t(), beta=0.0)
    gu = gu.values().view(n, k, two_i)
    act = F.silu(gu[..., :i]) * gu[..., i:] * w.gather(1, order).unsqueeze(-1)
    dense_act = torch.zeros(n, e, i).scatter_add_(1, sid.unsqueeze(-1).expand(n, k, i), act)
    return torch.bmm(dense_act.transpose(0, 1), ex.down_proj.transpose(1, 2)).sum(0)


def ways(ex: Experts) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {"dense": ex._dense, "loop": ex._grouped,
            "gmm": lambda x, i, w: selected_experts(x, i, w, ex.gate_up_proj, ex.down_proj), "sampled": lambda x, i, w: sampled(ex, x, i, w)}


def cpu_us(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        fn(*args)
    return (time.process_time() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,mid")
    ap.add_argument("--tokens", default="1,4,8,16,24,32,48,64,96,128,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=60, help="calls per timing (per round and way)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse")  # sparse CSR's beta notice, once per process
    out: dict[str, dict[str, dict[str, float | str]]] = {}
    print(f"{'shape':<6}{'N':>5}" + "".join(f"{w:>10}" for w in ways(Experts(1, 1, 1))) + "  fastest   pick  (us of CPU per call)")
    for shape in args.shapes.split(","):
        e, k, h, i = SHAPES[shape]
        torch.manual_seed(0)
        ex = Experts(e, h, i)
        with torch.no_grad():
            ex.gate_up_proj.normal_(0, h**-0.5)
            ex.down_proj.normal_(0, i**-0.5)
        out[shape] = {}
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, h)
            ids = torch.rand(n, e).argsort(dim=1)[:, :k]  # k distinct experts per token
            w = torch.softmax(torch.randn(n, k), dim=-1)
            fns = ways(ex)
            times: dict[str, list[float]] = {name: [] for name in fns}
            with torch.inference_mode():
                ref = fns["dense"](x, ids, w)
                for name, fn in fns.items():  # each way computes the same layer output
                    torch.testing.assert_close(fn(x, ids, w), ref, rtol=1e-4, atol=1e-5, msg=name)
                calls = max(3, args.calls * 8 // max(n, 8))
                for r in range(args.rounds):
                    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                    for name in order:
                        times[name].append(cpu_us(fns[name], (x, ids, w), calls))
            med = {name: round(statistics.median(v), 1) for name, v in times.items()}
            out[shape][str(n)] = dict(med)
            best = min(med, key=lambda m: med[m])
            pick = "dense" if prefer_dense(n, k, e, 2 * i, h, 4) else "gmm"
            out[shape][str(n)]["pick"] = pick
            print(f"{shape:<6}{n:>5}" + "".join(f"{med[name]:>10.1f}" for name in med) + f"{best:>9}{pick:>7}",
                  flush=True)
    print(json.dumps({"cpu_us_per_call": out, "shapes": {s: SHAPES[s] for s in args.shapes.split(",")}}))


if __name__ == "__main__":
    main()
