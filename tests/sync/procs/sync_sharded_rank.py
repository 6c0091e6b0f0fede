"""One FSDP trainer rank of the sharded-sync test: argv = rank world port directory out_dir transports.

Every rank pushes 3 versions per transport (a full one, then two that may go as deltas), each rank sending only its own slices
(`export_sharded_state` + `ShardedWeightSync`). Each version first changes every rank's
shard (a deterministic update of the local slices, standing in for an optimizer step).
The export and push run under an allocation tracker (every tensor an op creates on this
thread); after each version, outside the tracker, the ranks gather the model the old way
(a collective) and rank 0 compares its per-tensor checksums with what each engine holds.
Rank r writes out_dir/rank{r}.json: its shard bytes, bucket bytes, the tracked allocations
and (rank 0) the per-version comparisons and sync reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from miles.actors.messages import Checksums
from miles.actors.runtime.host import Host
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import TrainerConfig
from miles.core.schema.transport import TransportConfig
from miles.launch.role import exit_now
from miles.models.hf_io import tensor_checksum
from miles.trainer.dist import leave_process_group
from miles.trainer.fsdp import FSDPTrainer
from miles.weightsync.actor_wire import ShardedWeightSync
from miles.weightsync.shard_publisher import ShardedPublisher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sync_helpers import spec  # noqa: E402 - the engines' architecture, shared with the test

VERSIONS = 3  # the first full, then deltas, the last verified: each path once more than it needs
BUCKET = 64 << 10  # several buckets per rank


class AllocTracker(TorchDispatchMode):
    """Every tensor an op on this thread creates (outputs that alias no input): the largest
    one and their sum. Views and in-place results share an input's storage and are skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t)[0] for t in tree_leaves((args, kwargs or {}))}
        for t in tree_leaves(out):
            ptr, n = _storage(t)
            if ptr not in seen and n:
                self.largest = max(self.largest, n)
                self.total += n
        return out


def _storage(t: Any) -> tuple[int, int]:
    """(storage address, bytes) of a plain tensor; (0, 0) for anything else (a DTensor or a
    collective's wrapper: the plain tensor inside is an op's output of its own)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return 0, 0
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except RuntimeError:
        return 0, 0


@torch.no_grad()
def update(trainer: FSDPTrainer, version: int, share: float = 1.0) -> None:
    """Change `share` of the elements of this rank's slice of every parameter (deterministic per
    rank and version)."""
    g = torch.Generator().manual_seed(1000 * version + trainer.rank)
    for p in trainer.policy.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        step = torch.randn(local.shape, generator=g) * 0.01
        local.add_(step if share >= 1.0 else step * (torch.rand(local.shape, generator=g) < share))


async def run(trainer: FSDPTrainer, directory: str, out: Path, transports: list[str]) -> dict[str, Any]:
    host = Host(TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0), directory)
    await host.start()
    rec: dict[str, Any] = {"checks": [], "reports": []}
    version = 0
    # The tracker sees a gather: the old path's export, tracked the same way (a collective).
    gathered = AllocTracker()
    with gathered:
        for _ in trainer.export_hf_state():
            pass
    rec["gathered_total"] = gathered.total
    try:
        for name in transports:  # "<transport>-delta": a sparse update, sent as deltas after the first
            transport, delta = name.removesuffix("-delta"), name.endswith("-delta")
            # "ucx-serial": no receive-ahead, each bucket received when its header comes up
            transport, serial = transport.removesuffix("-serial"), transport.endswith("-serial")
            cfg = SyncConfig(transport=transport, step_timeout_s=30, pause_mode="none",  # type: ignore[arg-type]
                             verify_every=VERSIONS)
            if serial:
                cfg.receive_ahead_mib = 0
            sync = ShardedWeightSync(host, cfg, ["e0", "e1"], bucket_bytes=BUCKET, delta=delta)
            try:
                for _ in range(VERSIONS):
                    version += 1
                    update(trainer, version, 0.02 if delta else 1.0)
                    tracker = AllocTracker()
                    with tracker:
                        ex = trainer.export_sharded_state()
                        rep = await sync.push(version, ex)
                    key = "_delta" if delta else ""  # a delta sync keeps one more shard: its base
                    rec["largest" + key] = max(rec.get("largest" + key, 0), tracker.largest)
                    rec["total_max" + key] = max(rec.get("total_max" + key, 0), tracker.total)
                    rec["shard_bytes"] = int(ex.buffer.numel())
                    # The independent check: the gathered model (old path, outside the tracker).
                    want = await asyncio.to_thread(lambda: {k: tensor_checksum(v) for k, v in trainer.export_hf_state()})
                    if trainer.rank == 0:
                        held = [await host.ref(e).ask(Checksums(), timeout=30) for e in ("e0", "e1")]
                        rec["checks"].append({"transport": name, "version": version,
                                              "exact": [h == want for h in held]})
                        rec["reports"].append({"transport": name, "version": version, "committed": rep.committed,
                                               "dead": rep.dead, "verified": rep.verified, "buckets": rep.buckets,
                                               "bytes": rep.bytes, "full_bytes": rep.full_bytes})
            finally:
                await sync.close()
        # The trainer loop's hand-off (weightsync/shard_publisher.py) on every rank: export in a worker
        # thread, push with the engines paused in place, rank 0 announces.
        cfg = SyncConfig(transport="zmq", step_timeout_s=30, pause_mode="in_place", verify_every=1)
        sync = ShardedWeightSync(host, cfg, ["e0", "e1"], bucket_bytes=BUCKET)
        pub = ShardedPublisher(cfg, trainer, sync)
        announced: list[int] = []
        try:
            version += 1
            update(trainer, version)

            async def announce() -> None:
                announced.append(version)

            metrics = await pub.hand_off(version, announce)
            want = await asyncio.to_thread(lambda: {k: tensor_checksum(v) for k, v in trainer.export_hf_state()})
            held = [await host.ref(e).ask(Checksums(), timeout=30) for e in ("e0", "e1")] if trainer.rank == 0 else []
            rec["publisher"] = {"exact": [h == want for h in held], "announced": announced, "version": version,
                                "payload": metrics["sync/payload_bytes"], "last_version": pub.last_version}
        finally:
            await sync.close()
    finally:
        await host.stop()
    return rec


def main() -> None:
    rank, world, port, directory, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    transports = sys.argv[6].split(",")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.world_size = world
    trainer = FSDPTrainer(cfg, spec(hidden=128), rank, world, seed=7)
    rec = asyncio.run(run(trainer, directory, out, transports))
    rec["bucket_bytes"] = BUCKET
    rec["versions"] = VERSIONS
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    # Leave without interpreter teardown: torch's background
    # threads can abort a multi-rank process at exit ("terminate called without an active
    # exception", seen in CI) after every output above is written and closed.
    trainer.close()
    leave_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
