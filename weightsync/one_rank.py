"""A gathered export as a sharded sync with one rank: the pieces that make the two one protocol.

Rank 0's flat export (weightsync/flat.py `FlatWeights`: every HF tensor back to back in one
buffer) is exactly what a one-rank sharded export is: `one_rank_export` gives the transfer plan
whose one rank owns every tensor whole, with the flat buffer itself as its send buffer (no
copy), and whose engine plan is the flat plan unchanged; each tensor travels in its own dtype
(several dtypes and 0-d tensors included). `SoloRankGroup` is the `RankGroup` of a
single process (no torch.distributed). With both, `ShardedCoordinator` pushes a gathered flat
export over the sharded channels (zmq, ucx, broadcast).

`GatheredSync` (weightsync/trainer_sync.py) pushes every export over zmq, ucx and (from a CPU
trainer) broadcast this way, a tensor-by-tensor one packed into a flat buffer first (`FlatWeights.pack`);
weightsync/coordinator.py's docstring says what still goes through the gathered coordinator.
A one-rank plan's buckets are the flat plan's ranges (`OneRankPlan`), as the gathered coordinator
cuts a flat export.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.errors import SyncError
from miles.weightsync.flat import FlatPlan, FlatWeights
from miles.weightsync.shard_plan import (
    EngineLayout,
    HFPart,
    ParamLayout,
    ShardBucket,
    ShardExport,
    TrainerLayout,
    TransferPlan,
)


class SoloRankGroup:
    """The `RankGroup` (weightsync/rank_group.py) of one process: every collective is its own."""

    rank = 0
    size = 1

    async def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    async def send(self, t: torch.Tensor, dst: int) -> None:
        raise SyncError(f"a one-rank group has no rank {dst} to send to")

    async def recv(self, t: torch.Tensor, src: int) -> None:
        raise SyncError(f"a one-rank group has no rank {src} to receive from")


class OneRankPlan(TransferPlan):
    """The transfer plan of a one-rank sharded sync: its buckets are the flat plan's byte ranges.

    Those are cut at tensor boundaries (`FlatPlan.ranges`: at most a bucket each; a tensor larger
    than a bucket in bucket-sized pieces), as the gathered coordinator cuts a flat export, not at
    every `bucket_bytes` across tensors as a multi-rank plan's are. Measured on the CPU (gloo
    broadcast over loopback, bench/results/weight_sync_one_rank_s19.txt), the cut across tensors,
    with every bucket full size, made the one-rank broadcast push 8-17 % slower than the gathered
    one: each broadcast moved fewer bytes per second the fuller the bucket; cut like the gathered
    flat path, the two pushes take the same time."""

    def buckets(self, rank: int, group: int, bucket_bytes: int) -> list[ShardBucket]:
        if rank != 0 or group != 0:
            raise SyncError(f"a one-rank plan has rank 0 and engine group 0 only, not rank {rank} group {group}")
        # the send buffer is laid out as the flat plan (checked in `one_rank_plan`): src == dst
        return [ShardBucket(((lo, lo, hi - lo),), hi - lo) for lo, hi in self.engines[0].plan.ranges(bucket_bytes)]


def one_rank_plan(plan: FlatPlan) -> TransferPlan | None:
    """The transfer plan of a one-rank sharded sync of flat plan `plan`: one rank owns every
    tensor whole, its send buffer laid out as the flat buffer, the engines' plan `plan` itself.

    Each tensor is one parameter of one row segment (a 0-d tensor: one row of no trailing dims)
    that travels in its own dtype: FP8 codes (as uint8) beside fp32 scales, bf16 weights beside
    fp32 norms. None where the transfer plan would lay the bytes out otherwise (a tensor of no
    elements has no piece; otherwise a safety check: the plan code places a whole-tensor,
    one-rank layout back to back in engine order)."""
    if not plan.names:
        return None
    wire = plan.dtypes[0]
    params = []
    for n, dt, s in zip(plan.names, plan.dtypes, plan.shapes, strict=True):
        rows = s[0] if s else 1
        params.append(ParamLayout(n, tuple(s), (HFPart(n, None, (0, rows), tuple(s[1:])),), ((0, rows),),
                                  dtype="" if dt == wire else dt))
    transfer = OneRankPlan(TrainerLayout(tuple(params), 1, wire), [EngineLayout(plan)])
    pieces = transfer.pieces[0]
    if transfer.send_bytes[0] != plan.nbytes or len(pieces) != len(plan.names) or any(
            p.src != off or p.dst != off for p, off in zip(pieces, plan.offsets, strict=True)):
        return None  # the send buffer would be laid out differently from the flat buffer
    return transfer


def one_rank_export(weights: FlatWeights, transfer: TransferPlan | None = None) -> ShardExport | None:
    """`weights` as rank 0's export of a one-rank sharded sync, sending from its own buffer (no
    copy); None where its flat plan has no one-rank transfer plan (`one_rank_plan`). `transfer`:
    that plan when the caller keeps it (it is the same for every version of one flat plan)."""
    transfer = transfer if transfer is not None else one_rank_plan(weights.plan)
    if transfer is None:
        return None
    return ShardExport(weights.buffer.reshape(-1).view(torch.uint8), transfer, 0)
