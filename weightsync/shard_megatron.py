"""Megatron-core TP/EP/PP trainer layouts for the sharded-sync transfer plan, and the packing
of one rank's send buffer from its local (tensor-parallel) weights.

A Megatron rank holds, per parameter, its tensor-parallel slice. Concatenating the TP ranks'
slices (dim 0 for column-parallel and vocab-parallel layers, dim 1 for row-parallel ones)
gives a "TP-global" parameter whose rows or columns each rank owns as one contiguous range:
that is a `ParamLayout` of the plan. What differs from FSDP is how HF tensors sit inside it:

  linear_qkv   [G * (q_per_group + 2 * head_dim), H], per query group g: [q rows of the
               group's heads | k_g | v_g] (megatron-core SelfAttention splits each group's
               row block as [np/ng * hn, hn, hn]); q_proj, k_proj and v_proj are G row
               segments each, and a TP rank holds G / tp whole groups, so every HF tensor's
               rows come from every TP rank;
  linear_fc1   gate and up each split over TP, rank t holding [gate_t; up_t]: gate_proj and
               up_proj are tp segments each, interleaved in the TP-global parameter;
  linear_proj, linear_fc2 (row-parallel)  columns [t*C/tp, (t+1)*C/tp) of o_proj/down_proj
               on rank t: a column block, strided in HF bytes (`ParamLayout(dim=1)`);
  embedding, output_layer (vocab-parallel)  rows;
  norms, router, row-parallel biases  replicated: one rank sends them;
  experts      whole experts per EP rank; each expert's fc1/fc2 split over the expert
               tensor-parallel size `etp` like the dense ones (etp = 1: not split).

Ranks follow megatron-core's default order (tp fastest, then dp, pp last) for the dense
layers, and `tp(=etp)-ep-dp-pp` for the expert layers. Dense layers are replicated over
the `dp` data-parallel replicas and experts over the `tp * dp / (etp * ep)` expert-data
replicas; only one replica sends each parameter (chosen round-robin by layer or expert so
the replicas share the sending). Nothing here imports megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from miles.core.errors import SyncError
from miles.transport.bulk.base import dtype_of
from miles.weightsync.shard_plan import (
    EngineLayout,
    HFPart,
    ParamLayout,
    Rows,
    ShardExport,
    TrainerLayout,
    TransferPlan,
)


class MegatronTarget(Protocol):
    """One megatron parameter and the HF tensors it is made of (trainer/megatron/layout.py `Target`)."""

    @property
    def mcore(self) -> str: ...
    @property
    def hf(self) -> tuple[str, ...]: ...
    @property
    def kind(self) -> str: ...  # copy | row | col | qkv | glu
    @property
    def layer(self) -> int: ...  # decoder layer, -1 outside the decoder
    @property
    def expert(self) -> int | None: ...  # global expert id of an expert parameter


@dataclass(frozen=True)
class MegatronParallel:
    """Megatron's parallel sizes. World = tp * dp * pp ranks; the expert layers regroup each
    stage's tp * dp ranks as etp × ep × expert-data replicas."""

    tp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor-parallel size (the miles megatron backend uses 1)
    pp: int = 1
    dp: int = 1  # data-parallel replicas of the dense layers

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)

    def check(self, num_layers: int) -> None:
        sizes = {"tp": self.tp, "ep": self.ep, "etp": self.etp, "pp": self.pp, "dp": self.dp}
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if bad:
            raise SyncError(f"megatron layout: parallel sizes must be >= 1, got {', '.join(bad)}")
        if (self.tp * self.dp) % (self.etp * self.ep):
            raise SyncError(f"megatron layout: etp * ep = {self.etp * self.ep} does not divide the "
                            f"tp * dp = {self.tp * self.dp} ranks of a pipeline stage")
        if num_layers % self.pp:
            raise SyncError(f"megatron layout: pp={self.pp} does not divide {num_layers} layers")

    def dense_rank(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return stage * self.tp * self.dp + dp_rank * self.tp + tp_rank

    def expert_rank(self, stage: int, edp_rank: int, ep_rank: int, etp_rank: int) -> int:
        return stage * self.tp * self.dp + (edp_rank * self.ep + ep_rank) * self.etp + etp_rank


def param_key(t: MegatronTarget) -> str:
    """The plan's name of a megatron parameter: its name, plus the global expert id for an expert
    (a local expert's name repeats on every EP rank)."""
    return t.mcore if t.expert is None else f"{t.mcore}@expert{t.expert}"


def _chunks(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise SyncError(f"megatron layout: {what} has {n} rows/columns, not divisible by {parts} ranks")
    return n // parts


def _param(t: MegatronTarget, shapes: Mapping[str, tuple[int, ...]], kv_heads: int,
           ranks: list[int], world: int) -> ParamLayout:
    """`t` as a plan parameter: TP-global shape, HF segments, and `ranks[i]` owning slice i."""
    try:
        hs = [tuple(shapes[n]) for n in t.hf]
    except KeyError as exc:
        raise SyncError(f"megatron layout: no HF shape for {exc} (parameter {t.mcore!r})") from None
    if any(not s for s in hs):
        raise SyncError(f"megatron layout: parameter {t.mcore!r} has a 0-d HF tensor")
    first, rest = hs[0], hs[0][1:]
    tp = len(ranks)
    kind = t.kind
    if kind == "col" and len(first) == 1:  # a row-parallel layer's bias is replicated
        kind = "copy"
    parts: list[HFPart] = []
    dim = 0
    if kind in ("copy", "row"):
        n, shape = first[0], first
        parts = [HFPart(t.hf[0], None, (0, n), rest)]
        if kind == "copy":
            ranks = ranks[:1]
    elif kind == "col":
        n, shape, dim = first[1], first, 1
        parts = [HFPart(t.hf[0], None, (0, first[0]), rest)]
    elif kind == "qkv":
        (qr, *_), (kr, *_), (vr, *_) = hs
        if kr != vr or qr % kv_heads or kr % kv_heads or kv_heads % tp:
            raise SyncError(f"megatron layout: {t.mcore!r}: q/k/v rows {qr}/{kr}/{vr} do not form {kv_heads} "
                            f"query groups split over tp={tp} (tp must divide the KV heads)")
        per, hd = qr // kv_heads, kr // kv_heads
        block = per + 2 * hd
        for g in range(kv_heads):
            b = g * block
            parts += [HFPart(t.hf[0], None, (b, b + per), rest, g * per, qr),
                      HFPart(t.hf[1], None, (b + per, b + per + hd), rest, g * hd, kr),
                      HFPart(t.hf[2], None, (b + per + hd, b + block), rest, g * hd, kr)]
        n = kv_heads * block
        shape = (n, *rest)
    elif kind == "glu":
        if len(hs) != 2 or hs[0] != hs[1]:
            raise SyncError(f"megatron layout: {t.mcore!r}: gate/up shapes {hs} differ")
        s = _chunks(first[0], tp, f"{t.hf[0]}")
        for i in range(tp):  # TP-global rows: [gate_0; up_0; gate_1; up_1; ...]
            parts += [HFPart(t.hf[0], None, (2 * i * s, 2 * i * s + s), rest, i * s, first[0]),
                      HFPart(t.hf[1], None, (2 * i * s + s, 2 * (i + 1) * s), rest, i * s, first[0])]
        n = 2 * first[0]
        shape = (n, *rest)
    else:
        raise SyncError(f"megatron layout: parameter {t.mcore!r} has unknown kind {t.kind!r}")
    c = _chunks(n, len(ranks), t.mcore)
    owned: list[Rows] = [(0, 0)] * world
    for i, r in enumerate(ranks):
        owned[r] = (i * c, (i + 1) * c)
    return ParamLayout(param_key(t), shape, tuple(parts), tuple(owned), dim)


def megatron_layout(targets_of: Callable[[int], Sequence[MegatronTarget]], hf_shapes: Mapping[str, tuple[int, ...]],
                    *, kv_heads: int, num_layers: int, par: MegatronParallel, dtype: str) -> TrainerLayout:
    """The trainer layout of a megatron-core GPT/MoE model: `targets_of(ep_rank)` lists the
    parameters of EP rank `ep_rank` (trainer/megatron/layout.py `targets`; dense ones are the
    same on every EP rank), `hf_shapes` the full shape of every HF tensor."""
    par.check(num_layers)
    per_stage = num_layers // par.pp
    params: list[ParamLayout] = []
    for ep_rank in range(par.ep):
        for t in targets_of(ep_rank):
            if t.expert is None and ep_rank:
                continue
            stage = t.layer // per_stage if t.layer >= 0 else (0 if t.mcore.startswith("embedding.") else par.pp - 1)
            if t.expert is None:
                d = t.layer % par.dp if t.layer >= 0 else 0
                ranks = [par.dense_rank(stage, d, i) for i in range(par.tp)]
            else:
                ranks = [par.expert_rank(stage, t.expert % par.edp, ep_rank, i) for i in range(par.etp)]
            params.append(_param(t, hf_shapes, kv_heads, ranks, par.world))
    return TrainerLayout(tuple(params), par.world, dtype)


def local_shape(prm: ParamLayout, rank: int) -> tuple[int, ...]:
    """The shape of `rank`'s local tensor of `prm` (its slice of dim `prm.dim`)."""
    a, b = prm.owned[rank]
    shape = list(prm.shape)
    shape[prm.dim] = b - a
    return tuple(shape)


@torch.no_grad()
def pack_rank(plan: TransferPlan, rank: int, local: Mapping[str, torch.Tensor]) -> ShardExport:
    """Rank `rank`'s send buffer: its own slices, cast to the wire dtype, in plan order. `local`
    maps each plan parameter the rank owns a slice of to its local tensor (megatron: the
    TP-local weight, under `param_key`). A column block is the rank's rows of its local
    [rows, cols] weight: contiguous, so it travels with no pack copy and is scattered into
    the engine's row-major slot by the receiver."""
    dt = dtype_of(plan.trainer.dtype)
    layouts = {p.name: p for p in plan.trainer.params}
    device = next(iter(local.values())).device if local else torch.device("cpu")
    buf = torch.empty(plan.send_bytes[rank], dtype=torch.uint8, device=device)
    checked: set[str] = set()
    for s in plan.sends[rank]:
        prm = layouts[s.param]
        t = local.get(s.param)
        if s.param not in checked:
            want = local_shape(prm, rank)
            if t is None or tuple(t.shape) != want:
                got = "nothing" if t is None else f"shape {tuple(t.shape)}"
                raise SyncError(f"sharded export: rank {rank} holds {got} of parameter {s.param!r}; its slice of "
                                f"{prm.shape} on dim {prm.dim} is {want}")
            checked.add(s.param)
        assert t is not None
        a = prm.owned[rank][0]
        if s.expert is not None:
            src = t[s.expert - a][s.param_rows[0]:s.param_rows[1]]
        elif prm.dim == 1:  # every row is local: the rank's columns of them
            src = t[s.param_rows[0]:s.param_rows[1]]
        else:
            src = t[s.param_rows[0] - a:s.param_rows[1] - a]
        buf[s.src:s.src + s.nbytes].view(dt).view(src.shape).copy_(src)
    return ShardExport(buf, plan, rank)


class MegatronShardExporter:
    """One megatron rank's sharded export (what `ShardedWeightSync` pushes from every rank):
    the layout and transfer plan are built once and rebuilt when the wire dtype changes; each
    export is `pack_rank` over the rank's local weights (keyed by `param_key`)."""

    def __init__(self, targets_of: Callable[[int], Sequence[MegatronTarget]],
                 hf_shapes: Mapping[str, tuple[int, ...]], *, kv_heads: int, num_layers: int,
                 par: MegatronParallel, rank: int) -> None:
        if not 0 <= rank < par.world:
            raise SyncError(f"megatron export: rank {rank} is outside the {par.world} ranks of {par}")
        self.targets_of, self.hf_shapes = targets_of, dict(hf_shapes)
        self.kv_heads, self.num_layers, self.par, self.rank = kv_heads, num_layers, par, rank
        self.plan: TransferPlan | None = None

    def fill(self, local: Mapping[str, torch.Tensor], dtype: str) -> ShardExport:
        if self.plan is None or self.plan.trainer.dtype != dtype:
            self.plan = None  # the old plan goes before the new one is built
            layout = megatron_layout(self.targets_of, self.hf_shapes, kv_heads=self.kv_heads,
                                     num_layers=self.num_layers, par=self.par, dtype=dtype)
            self.plan = TransferPlan(layout, [EngineLayout.whole(layout.hf_tensors(), dtype)])
        return pack_rank(self.plan, self.rank, local)
