"""A gathered export as a sharded sync with one rank: the pieces that make the two one protocol.

Rank 0's flat export (weightsync/flat.py `FlatWeights`: every HF tensor back to back in one
buffer) is exactly what a one-rank sharded export is: `one_rank_export` gives the transfer plan
whose one rank owns every tensor whole, with the flat buffer itself as its send buffer (no
copy), and whose engine plan is the flat plan unchanged. `SoloRankGroup` is the `RankGroup` of a
single process (no torch.distributed). With both, `ShardedCoordinator` pushes a gathered flat
export over the sharded channels (zmq, ucx, broadcast).

`GatheredSync` (weightsync/trainer_sync.py) pushes every flat export over zmq and ucx this way;
weightsync/coordinator.py's docstring says what still goes through the gathered coordinator.
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


def one_rank_plan(plan: FlatPlan) -> TransferPlan | None:
    """The transfer plan of a one-rank sharded sync of flat plan `plan`: one rank owns every
    tensor whole, its send buffer laid out as the flat buffer, the engines' plan `plan` itself;
    None where the flat plan is not a one-rank transfer plan's (tensors of several dtypes, a 0-d one)."""
    if len(set(plan.dtypes)) != 1 or any(not s for s in plan.shapes):
        return None
    wire = plan.dtypes[0]
    layout = TrainerLayout(tuple(ParamLayout(n, tuple(s), (HFPart(n, None, (0, s[0]), tuple(s[1:])),), ((0, s[0]),))
                                 for n, s in zip(plan.names, plan.shapes, strict=True)), 1, wire)
    transfer = TransferPlan(layout, [EngineLayout.whole(layout.hf_tensors(), wire)])
    if transfer.engines[0].plan != plan or transfer.send_bytes[0] != plan.nbytes or any(
            p.src != off for p, off in zip(transfer.pieces[0], plan.offsets, strict=True)):
        # the engines would get another plan, or the send buffer would be laid out differently
        return None
    return transfer


def one_rank_export(weights: FlatWeights, transfer: TransferPlan | None = None) -> ShardExport | None:
    """`weights` as rank 0's export of a one-rank sharded sync, sending from its own buffer (no
    copy); None where its flat plan has no one-rank transfer plan (`one_rank_plan`). `transfer`:
    that plan when the caller keeps it (it is the same for every version of one flat plan)."""
    transfer = transfer if transfer is not None else one_rank_plan(weights.plan)
    if transfer is None:
        return None
    return ShardExport(weights.buffer.reshape(-1).view(torch.uint8), transfer, 0)
