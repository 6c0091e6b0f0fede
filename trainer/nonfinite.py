"""The non-finite guard: an update whose gradient is not finite is never applied.

A single NaN or inf in the accumulated gradient, once stepped, makes every weight NaN; the
engines then sample from NaN logits and the whole run is lost (issue 44: three GPU runs died
this way). So both backends check the global gradient norm before the optimizer step and skip
the step when it is not finite (`skip_nonfinite`); the RL step counts the skip
(`train/skipped_nonfinite`) and, to say which input caused it, replays the mini-batch's
micro-batches one at a time (`find_culprit`) and logs the first one whose own gradient is not
finite, with what it held. The replay costs one more forward/backward per micro-batch, and only
in the step that failed.

On one rank, the culprit is then replayed twice more (`diagnose`): under autograd's anomaly
mode, which names the backward function that first produced a NaN, and on CUDA with every fused
attention kernel off (the flash varlen call of models/flash_varlen.py and SDPA's flash,
memory-efficient and cuDNN backends: the math kernel only), which says whether an attention kernel
is the cause. That is how session 16's NaN was traced to cuDNN's masked backward
(models/masked_sdpa.py). On
several ranks the replays are skipped: the culprit is found per rank, and a replay on one rank
alone would leave the others waiting in its collectives.

`nonfinite_params` is the last line of defence before a publish: weights that are not finite
are never sent to engines.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from miles.trainer.packing import MicroBatch


def skip_nonfinite(opt: torch.optim.Optimizer, norm: float) -> bool:
    """True (and the accumulated gradients dropped) when `norm` is not finite: no step then.
    The norm is global (all ranks reduce it), so every rank takes the same decision."""
    if math.isfinite(norm):
        return False
    opt.zero_grad(set_to_none=True)
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def nonfinite_grads(params: Iterable[tuple[str, nn.Parameter]], limit: int = 8) -> list[str]:
    """Names of (up to `limit`) parameters whose local gradient holds a NaN or inf."""
    named = [(n, _local(p.grad)) for n, p in params if p.grad is not None]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(g).all() for _, g in named]).cpu().tolist()
    return [n for (n, _), ok in zip(named, flags, strict=True) if not ok][:limit]


def nonfinite_params(params: Iterable[tuple[str, nn.Parameter]], limit: int = 8) -> list[str]:
    """Names of (up to `limit`) parameters whose local values hold a NaN or inf.
    One fused norm over all tensors and one host sync: ~1 ms for a 0.5B model on a GPU."""
    named = [(n, _local(p.detach())) for n, p in params]
    if not named:
        return []
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for _, t in named])
    flags = torch.isfinite(torch.stack(norms)).cpu().tolist()
    return [n for (n, _), ok in zip(named, flags, strict=True) if not ok][:limit]


def describe(mb: MicroBatch) -> dict[str, object]:
    """What a micro-batch held, for the log line of a skipped step."""
    f = mb.fields
    out: dict[str, object] = {
        "sample_ids": list(mb.sample_ids)[:16],
        "num_seqs": mb.num_seqs,
        "tokens": int(mb.input_ids.numel()),
        "loss_tokens": int((mb.loss_mask > 0).sum()),
    }
    for name in ("adv", "old_logp", "rollout_logp", "ref_logp"):
        t = f.get(name)
        if t is None or t.numel() == 0:
            continue
        t = t.float()
        fin = torch.isfinite(t)
        out[f"{name}_nonfinite"] = int((~fin).sum())
        if bool(fin.any()):
            out[f"{name}_min"] = round(float(t[fin].min()), 4)
            out[f"{name}_max"] = round(float(t[fin].max()), 4)
    if "old_logp" in f and "rollout_logp" in f and f["old_logp"].numel() == f["rollout_logp"].numel():
        d = (f["old_logp"].float() - f["rollout_logp"].float()).abs()
        d = d[torch.isfinite(d)]
        if d.numel():
            out["abs_dlogp_max"] = round(float(d.max()), 4)
    return out


def find_culprit(
    plan: list[MicroBatch],
    run_one: Callable[[MicroBatch], MicroBatch],
    params: Callable[[], Iterable[tuple[str, nn.Parameter]]],
    zero: Callable[[], None],
) -> dict[str, object]:
    """Replay each micro-batch of `plan` alone (forward and backward through `run_one`, which
    returns the micro-batch it ran) and
    return the first whose gradient is not finite: its index, what it held and the parameters
    hit. Gradients are dropped before each replay and after the last. {} when none is (the
    non-finite value came only from their sum, e.g. an overflow)."""
    found: dict[str, object] = {}
    for i, mb in enumerate(plan):
        zero()
        ran = run_one(mb)  # the device copy, with the fields the forward filled in
        bad = nonfinite_grads(params())
        if bad and not found:
            found = {"micro_batch": i, "params": bad, **describe(ran)}
            # keep replaying: on several ranks every rank must run as many collectives
    zero()
    return found


def diagnose(
    mb: MicroBatch,
    run_one: Callable[[MicroBatch], Any],
    params: Callable[[], Iterable[tuple[str, nn.Parameter]]],
    zero: Callable[[], None],
    cuda: bool,
) -> dict[str, object]:
    """Replay the culprit micro-batch `mb` (one rank only) to say where its NaN comes from:
    `anomaly` is autograd's message naming the first backward function that returned a NaN
    ('' when anomaly mode saw none); `finite_with_math_attention` whether the gradient is finite
    with the math attention kernel alone (None off CUDA, where no fused kernel runs; a string when
    the replay itself failed, e.g. out of memory: the math kernel holds every score)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from miles.models import flash_varlen

    out: dict[str, object] = {}
    zero()
    try:
        # its forward-trace warning would print a whole stack per NaN; the message names the function
        with warnings.catch_warnings(), torch.autograd.detect_anomaly(check_nan=True):
            warnings.simplefilter("ignore")
            run_one(mb)
        out["anomaly"] = ""
    except RuntimeError as exc:  # anomaly mode raises at the first backward function that made a NaN
        out["anomaly"] = str(exc).splitlines()[0][:300]
    zero()
    out["finite_with_math_attention"] = None
    if cuda:
        saved, flash_varlen.ENABLED = flash_varlen.ENABLED, False
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                run_one(mb)
            out["finite_with_math_attention"] = not nonfinite_grads(params())
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            out["finite_with_math_attention"] = f"replay failed: {str(exc).splitlines()[0][:200]}"
        finally:
            flash_varlen.ENABLED = saved
    zero()
    return out
