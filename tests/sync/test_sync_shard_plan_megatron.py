"""Megatron TP/EP trainer layouts in the sharded-sync plan (weightsync/shard_megatron.py),
on CPU without megatron: every rank's local weights are cut from random HF tensors by the
megatron backend's own loader transforms (trainer/megatron/layout.py: fused QKV per query
group, [gate_t; up_t], row-parallel columns, vocab rows, whole experts per EP rank), packed
by the plan, and landed by the real engine-side receiver (ShardReceiver, zmq channel: the
bytes ride with the header) through the flat landing into staging slots. The union of all
ranks' pieces must rebuild every HF tensor byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import torch

from miles.core.errors import SyncError
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.megatron.layout import fuse, targets, tp_shard
from miles.transport.bulk.base import LocalWeights
from miles.transport.bulk.shard_receiver import ShardReceiver, parse_ranges
from miles.weightsync.flat import FlatLanding, FlatPlan, FlatWeights
from miles.weightsync.flat_export import hf_parts
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions, bucket_bytes
from miles.weightsync.shard_megatron import (
    MegatronParallel,
    MegatronShardExporter,
    megatron_layout,
    pack_rank,
    param_key,
)
from miles.weightsync.shard_plan import (
    EngineLayout,
    ShardExport,
    TrainerLayout,
    TransferPlan,
    fsdp_rows,
)

from .test_sync_coordinator import ENGINES, Hub, LocalRankGroup, MemLink, zmq_sender

pytestmark = pytest.mark.timeout(60)


class BlockLink(MemLink):
    """MemLink counting a bucket's bytes from strided range entries too ([lo, width, stride, count])."""

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                    data: torch.Tensor | None = None) -> int:
        e = self.engines[engine]
        if e.staged_version != version:
            e.staged_version, e.staged_bytes = version, 0
        wire = msgpack.unpackb(msgpack.packb({k: v for k, v in header.items() if k != "data"}))
        await e.rx.recv_flat(wire | {"data": header["data"].clone()}, e.landing, e.local())  # type: ignore[attr-defined]
        e.staged_bytes += sum(w * c for _, w, _, c in parse_ranges(header["ranges"]))
        return e.staged_bytes


def _spec(arch: str) -> ModelSpec:
    extra: dict[str, Any] = {"num_attention_heads": 8, "num_key_value_heads": 4}  # tp=4 splits 4 query groups
    return ModelSpec.from_hf(tiny_config(arch, vocab_size=96, **extra))


def _hf(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {n: tuple(t.shape) for n, t in hf_tensor_views(build_model(spec, seed=0)).items()}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _locals(spec: ModelSpec, hf: dict[str, torch.Tensor], par: MegatronParallel) -> list[dict[str, torch.Tensor]]:
    """Every rank's megatron weights, cut the way the backend's loader (load_hf) cuts them."""
    out = []
    for r in range(par.world):
        tp_rank, etp_rank, ep_rank = r % par.tp, r % par.etp, (r // par.etp) % par.ep
        mine: dict[str, torch.Tensor] = {}
        for t in targets(spec, set(), 0, par.ep) + targets(spec, set(), ep_rank, par.ep):
            full = fuse(t.kind, [hf[n] for n in t.hf], spec)
            if t.expert is None:
                mine[param_key(t)] = tp_shard(t.kind, full, tp_rank, par.tp).contiguous()
            else:
                mine[param_key(t)] = tp_shard(t.kind, full, etp_rank, par.etp).contiguous()
        out.append(mine)
    return out


def _plan(spec: ModelSpec, hf: dict[str, torch.Tensor], par: MegatronParallel, dtype: str,
          groups: int = 1) -> TransferPlan:
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    layout = megatron_layout(lambda e: targets(spec, set(), e, par.ep), shapes, kv_heads=spec.num_kv_heads,
                             num_layers=spec.num_layers, par=par, dtype=dtype)
    tensors = layout.hf_tensors()
    if groups == 1:
        return TransferPlan(layout, [EngineLayout.whole(tensors, dtype)])
    return TransferPlan(layout, [EngineLayout.split(tensors, dtype, {n: fsdp_rows(s[0], g, groups) for n, s in tensors})
                                 for g in range(groups)])


async def _land(plan: TransferPlan, exports: list[ShardExport], group: int, bucket: int,
                flat: bool = True) -> torch.Tensor:
    """Every rank's buckets for engine group `group`, through the engine's receiver and landing
    (`flat`: slots laid out like the plan, strided blocks one copy; else a slot per tensor)."""
    fp = FlatPlan.from_wire(plan.engines[group].plan.to_wire())
    staging = torch.zeros(fp.nbytes, dtype=torch.uint8)
    slots = dict(FlatWeights(staging, fp))
    if not flat:
        slots = {n: t.clone() for n, t in slots.items()}
    local = LocalWeights(0, lambda n: slots[n], lambda n: slots[n])
    landing = FlatLanding(fp)
    rx = ShardReceiver({"channel": "zmq", "sources": []}, bucket)
    for ex in exports:
        for seq, b in enumerate(plan.buckets(ex.rank, group, bucket)):
            data = bucket_bytes(ex.buffer, b)
            header = {"src": ex.rank, "seq": seq, "ranges": b.ranges, "nbytes": data.numel(), "data": data.clone()}
            await rx.recv_flat(header, landing, local)
    return staging if flat else FlatWeights.copy_of(slots.items()).buffer


CASES = [  # arch, tp, ep, etp, dp, pp, wire dtype
    ("qwen3", 1, 1, 1, 1, 1, "float32"), ("qwen3", 2, 1, 1, 1, 1, "bfloat16"), ("qwen3", 4, 1, 1, 2, 1, "float32"),
    ("qwen2", 2, 1, 1, 1, 2, "float32"),  # q/k/v biases: 1-D fused QKV segments; two pipeline stages
    ("qwen3_moe", 1, 1, 1, 1, 1, "float32"), ("qwen3_moe", 1, 2, 1, 2, 1, "bfloat16"),
    ("qwen3_moe", 2, 1, 1, 1, 1, "float32"), ("qwen3_moe", 2, 2, 1, 1, 1, "float32"),
    ("qwen3_moe", 2, 2, 2, 2, 1, "bfloat16"), ("qwen3_moe", 4, 1, 4, 1, 1, "float32"),
    ("qwen3_moe", 4, 2, 1, 1, 1, "float32"), ("qwen3_moe", 4, 2, 2, 1, 2, "bfloat16"),
]


@pytest.mark.parametrize(("arch", "tp", "ep", "etp", "dp", "pp", "dtype"), CASES)
async def test_megatron_slices_rebuild_every_hf_tensor(arch: str, tp: int, ep: int, etp: int, dp: int, pp: int,
                                                       dtype: str) -> None:
    spec = _spec(arch)
    hf = _hf(spec, seed=tp * 10 + ep)
    par = MegatronParallel(tp=tp, ep=ep, etp=etp, pp=pp, dp=dp)
    plan = _plan(spec, hf, par, dtype)
    locals_ = _locals(spec, hf, par)
    exports = [pack_rank(plan, r, locals_[r]) for r in range(par.world)]
    want = FlatWeights.copy_of([(n, hf[n]) for n in plan.engines[0].plan.names], getattr(torch, dtype)).buffer
    assert sum(plan.send_bytes) == want.numel()  # every byte sent once: replicas send nothing twice
    for r, ex in enumerate(exports):  # a rank sends only what it holds
        held = sum(t.numel() * getattr(torch, dtype).itemsize for t in locals_[r].values())
        assert ex.buffer.numel() <= held
    strided = [p for ps in plan.pieces for p in ps if p.stride]
    assert bool(strided) == (tp > 1 or etp > 1)  # row-parallel slices are column blocks under TP
    buckets = [b for r in range(par.world) for b in plan.buckets(r, 0, 4096)]
    assert all(b.contiguous_src() is not None for b in buckets)  # column blocks too: sent with no pack copy
    assert any(len(x) == 4 for b in buckets for x in b.ranges) == bool(strided)  # rows as one strided entry
    got = await _land(plan, exports, 0, 4096)
    assert torch.equal(got, want)


async def test_megatron_slices_land_into_a_tp_split_engine() -> None:
    """Trainer TP=2 × EP=2 -> engines split on dim 0 in two groups: row-parallel column blocks
    are cut by the engine's rows, fused QKV segments by both."""
    spec = _spec("qwen3_moe")
    hf = _hf(spec, seed=5)
    par = MegatronParallel(tp=2, ep=2)
    plan = _plan(spec, hf, par, "float32", groups=2)
    locals_ = _locals(spec, hf, par)
    exports = [pack_rank(plan, r, locals_[r]) for r in range(par.world)]
    for g, eng in enumerate(plan.engines):
        want = FlatWeights.copy_of([(n, hf[n][slice(*eng.rows[n])]) for n in eng.plan.names], torch.float32).buffer
        assert torch.equal(await _land(plan, exports, g, 1000, flat=g == 0), want)


ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
COL_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
                "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")


def _tp_engine(tensors: list[tuple[str, tuple[int, ...]]], dtype: str, n: int) -> list[EngineLayout]:
    """An engine with TP = n, split the way SGLang/vLLM split a layer: column-parallel tensors
    by rows, row-parallel ones by columns, the rest (norms, router) whole on every TP rank."""
    groups = []
    for g in range(n):
        rows = {k: fsdp_rows(s[0], g, n) for k, s in tensors if k.endswith(COL_PARALLEL)}
        cols = {k: fsdp_rows(s[1], g, n) for k, s in tensors if k.endswith(ROW_PARALLEL)}
        groups.append(EngineLayout.split(tensors, dtype, rows, cols))
    return groups


def _slice(t: torch.Tensor, eng: EngineLayout, name: str) -> torch.Tensor:
    t = t[slice(*eng.rows[name])] if name in eng.rows else t
    return t[:, slice(*eng.cols[name])] if name in eng.cols else t


@pytest.mark.parametrize(("trainer", "tp", "ep", "engine_tp"), [("megatron", 2, 2, 2), ("megatron", 4, 1, 2),
                                                             ("megatron", 1, 2, 4), ("fsdp", 4, 1, 2)])
async def test_trainer_slices_land_into_an_engine_split_on_rows_and_columns(trainer: str, tp: int, ep: int,
                                                                           engine_tp: int) -> None:
    """Megatron or FSDP ranks -> a TP engine whose `o_proj`/`down_proj` slots are column slices:
    a trainer column block meets an engine column slice (both strided), FSDP whole rows are cut
    into the engine's columns (strided on the send side: packed per bucket)."""
    spec = _spec("qwen3_moe")
    hf = _hf(spec, seed=7)
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    if trainer == "megatron":
        par = MegatronParallel(tp=tp, ep=ep, dp=max(1, ep // tp))
        layout = megatron_layout(lambda e: targets(spec, set(), e, par.ep), shapes, kv_heads=spec.num_kv_heads,
                                 num_layers=spec.num_layers, par=par, dtype="float32")
        locals_ = _locals(spec, hf, par)
    else:
        model = build_model(spec, seed=7)
        views = hf_tensor_views(model)
        hf = {n: t.detach().clone() for n, t in views.items()}
        full = {n: tuple(p.shape) for n, p in model.named_parameters()}
        layout = TrainerLayout.fsdp([(n, s, hf_parts(spec, n, s)) for n, s in full.items()], tp, "float32")
        locals_ = [{n: p.data[slice(*fsdp_rows(p.shape[0], r, tp))] for n, p in model.named_parameters()}
                   for r in range(tp)]
    groups = _tp_engine(layout.hf_tensors(), "float32", engine_tp)
    plan = TransferPlan(layout, groups)
    exports = [pack_rank(plan, r, locals_[r]) for r in range(layout.world)]
    assert sum(plan.send_bytes) == sum(t.numel() * 4 for t in hf.values())  # the send buffers: each byte once
    for g, eng in enumerate(plan.engines):
        want = FlatWeights.copy_of([(n, _slice(hf[n], eng, n)) for n in eng.plan.names], torch.float32).buffer
        assert torch.equal(await _land(plan, exports, g, 1000, flat=g % 2 == 0), want), g


@pytest.mark.parametrize("delta", [False, True])
async def test_megatron_ranks_push_through_the_coordinator_and_verify(delta: bool) -> None:
    """4 megatron ranks (tp=2, ep=2) -> 2 in-process engines over the real coordinator: exact
    bytes, commit, and the checksum verify that streams interleaved column blocks. With deltas,
    version 2 changes ~1 % of the elements and its column blocks travel sparse."""
    spec = _spec("qwen3_moe")
    par = MegatronParallel(tp=2, ep=2)
    link = BlockLink()
    hub = Hub(par.world)
    coords = [ShardedCoordinator(link, LocalRankGroup(hub, r), zmq_sender(r, par.world), ENGINES,
                                 ShardedOptions(4096, 2, "in_place", 1, delta=delta)) for r in range(par.world)]
    shapes = {n: tuple(t.shape) for n, t in _hf(spec, 0).items()}
    exporters = [MegatronShardExporter(lambda e: targets(spec, set(), e, par.ep), shapes, kv_heads=spec.num_kv_heads,
                                       num_layers=spec.num_layers, par=par, rank=r) for r in range(par.world)]
    hf = _hf(spec, seed=1)
    g = torch.Generator().manual_seed(0)
    for version in (1, 2):
        if version == 2:
            hf = {n: t + (torch.rand(t.shape, generator=g) < 0.01) * 0.5 for n, t in hf.items()}
        locals_ = _locals(spec, hf, par)
        exports = [x.fill(locals_[r], "float32") for r, x in enumerate(exporters)]
        assert exports[0].plan is exporters[0].plan  # built once, reused by the next version
        reps = await asyncio.gather(*(c.push(version, e) for c, e in zip(coords, exports, strict=True)))
        want = FlatWeights.copy_of([(n, hf[n]) for n in exports[0].plan.engines[0].plan.names], torch.float32).buffer
        assert all(rep.committed == ENGINES and rep.verified is True for rep in reps), reps
        assert all(torch.equal(e.live, want) for e in link.engines.values())
        if version == 2:
            assert (sum(r.bytes for r in reps) < 0.1 * sum(r.full_bytes for r in reps)) == delta, reps
    # a wrong byte on one engine is caught by the streamed verify
    link.engines["e1"].live[-1] ^= 1
    with pytest.raises(SyncError, match="checksum mismatch on engine 'e1'"):
        await asyncio.gather(*(c.verify(e, ENGINES) for c, e in zip(coords, exports, strict=True)))
    await asyncio.gather(*(c.close() for c in coords))


def test_megatron_layout_refuses_what_megatron_cannot_split() -> None:
    spec = _spec("qwen3_moe")
    shapes = {n: tuple(t.shape) for n, t in _hf(spec, 0).items()}

    def build(par: MegatronParallel, kv: int = spec.num_kv_heads) -> None:
        megatron_layout(lambda e: targets(spec, set(), e, par.ep), shapes, kv_heads=kv,
                        num_layers=spec.num_layers, par=par, dtype="float32")

    with pytest.raises(SyncError, match="tp must divide the KV heads"):
        build(MegatronParallel(tp=8))
    with pytest.raises(SyncError, match="etp \\* ep = 4 does not divide"):
        build(MegatronParallel(tp=1, ep=2, etp=2))
    with pytest.raises(SyncError, match="pp=3 does not divide"):
        build(MegatronParallel(pp=3))
    layout = megatron_layout(lambda e: targets(spec, set(), e, 1), shapes, kv_heads=spec.num_kv_heads,
                             num_layers=spec.num_layers, par=MegatronParallel(tp=2), dtype="float32")
    plan = TransferPlan(layout, [EngineLayout.whole(layout.hf_tensors(), "float32")])
    with pytest.raises(SyncError, match="holds shape"):  # a rank handed the wrong slice
        pack_rank(plan, 0, {k: torch.zeros(3, 3) for k in (p.name for p in layout.params)})


@pytest.mark.parametrize(("tp", "ep", "dp", "dtype"), [(2, 2, 2, "float32"), (2, 1, 1, "bfloat16")])
async def test_the_megatron_backends_sharded_export_rebuilds_every_hf_tensor(tp: int, ep: int, dp: int,
                                                                             dtype: str) -> None:
    """MegatronTrainer.export_sharded_state's plain part (weightsync/megatron_export.py): each
    rank's parameters by megatron name, cut as the backend's loader cuts them, become send
    buffers whose union lands every HF tensor byte for byte."""
    from miles.weightsync.megatron_export import MegatronShards

    spec = _spec("qwen3_moe")
    hf = _hf(spec, seed=3)
    par = MegatronParallel(tp=tp, ep=ep, dp=dp)
    exports = []
    for r in range(par.world):
        tp_rank, ep_rank = r % par.tp, (r // par.etp) % par.ep
        params = {t.mcore: tp_shard(t.kind, fuse(t.kind, [hf[n] for n in t.hf], spec),
                                    tp_rank if t.expert is None else 0, tp if t.expert is None else 1).contiguous()
                  for t in targets(spec, set(), ep_rank, ep)}
        shards = MegatronShards(spec, params.keys(), par, r, ep_rank, targets)
        exports.append(shards.export(params, dtype))
        assert shards.export(params, dtype).plan is exports[-1].plan  # built once
    plan = exports[0].plan
    want = FlatWeights.copy_of([(n, hf[n]) for n in plan.engines[0].plan.names], getattr(torch, dtype)).buffer
    assert torch.equal(await _land(plan, exports, 0, 4096), want)
