"""One CUDA device per member of a broadcast group, checked before its NCCL communicator exists.

NCCL cannot put two ranks of one communicator on the same GPU: its init fails ("Duplicate GPU
detected"), and members that never see the failure wait in init for ever (a trainer and two
engines on one H100 hung so in the broadcast channel's GPU test). So every member of an NCCL
group first publishes its device under its group rank in the group's TCPStore and reads every
other member's; when two members share a GPU, each raises the same `SyncError` naming them and
the fix, and no communicator is made. The identity is the GPU's UUID (what NCCL compares; an
index means a different GPU on another host or under another CUDA_VISIBLE_DEVICES); host and
index are only for the message. Values are JSON strings: nothing is pickled.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from miles.core.errors import SyncError

if TYPE_CHECKING:
    import torch

KEY = "miles/member_device/"  # + group rank; the store is the group's own (fresh per open)
FIX = ("the broadcast channel needs one GPU per member (every engine and every sending trainer rank on a "
       "device of its own); for engines on the trainer's GPU set sync.transport = 'cuda_ipc' or 'zmq'")


@dataclass(frozen=True)
class MemberDevice:
    """The CUDA device one member of a broadcast group runs its NCCL work on."""

    rank: int  # in the group: trainer ranks first, then the engines
    who: str  # "trainer rank 0", "engine 'engine-1'"
    host: str
    index: int  # the CUDA index in that member's process
    uuid: str  # the GPU's UUID: equal UUIDs are one GPU

    @classmethod
    def of(cls, rank: int, who: str, device: torch.device) -> MemberDevice:
        """This process's member on `device` (no index: the current device of the calling thread)."""
        import torch  # here: the launcher reads FIX from this module and never imports torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return cls(rank, who, socket.gethostname(), index, uuid)

    def label(self) -> str:
        return f"{self.who} (group rank {self.rank}, {self.host} cuda:{self.index})"

    def to_wire(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_wire(cls, raw: bytes | str) -> MemberDevice:
        try:
            d = json.loads(raw)
            return cls(int(d["rank"]), str(d["who"]), str(d["host"]), int(d["index"]), str(d["uuid"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise SyncError(f"broadcast group: a member published a malformed device {raw!r}: {exc}") from exc


def shared_devices(members: list[MemberDevice]) -> list[list[MemberDevice]]:
    """The members that share a GPU, in groups of two or more (in rank order); empty: one GPU each."""
    by_gpu: dict[str, list[MemberDevice]] = {}
    for m in sorted(members, key=lambda m: m.rank):
        by_gpu.setdefault(m.uuid, []).append(m)
    return [g for g in by_gpu.values() if len(g) > 1]


def check_one_gpu_each(members: list[MemberDevice]) -> None:
    """SyncError naming every set of members on one GPU, the GPU and the fix."""
    shared = shared_devices(members)
    if shared:
        what = "; ".join(f"{' and '.join(m.label() for m in g)} share one GPU ({g[0].uuid})" for g in shared)
        raise SyncError(f"broadcast group of {len(members)} members: {what}. NCCL cannot place two ranks of one "
                        f"group on one GPU (it fails or hangs at init). Fix: {FIX}")


def agree_devices(store: Any, me: MemberDevice, world: int) -> list[MemberDevice]:
    """Publish `me` and read every member's device (waiting up to the store's timeout for the
    late ones); SyncError if a member never published or two share a GPU. Every member calls it
    before making the group, so every member raises the same error."""
    store.set(KEY + str(me.rank), me.to_wire())
    keys = [KEY + str(r) for r in range(world)]
    try:
        raw = store.multi_get(keys)
    except RuntimeError as exc:  # DistStoreError: the store's timeout passed
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise SyncError(f"broadcast group: group ranks {missing} never joined ({me.who} waited for them: "
                        f"{exc})") from exc
    members = [MemberDevice.from_wire(v) for v in raw]
    check_one_gpu_each(members)
    return members
