"""One FSDP trainer rank for the 2-rank sync test: argv = rank world port directory out_dir.

Both ranks train one step on their shard of a fixed batch, then push one version per
transport (zmq, ucx when UCXX is installed, broadcast, disk_delta): the export is a
collective every rank drains, and rank 0 streams it through WeightSync to the engines.
Rank 0 then writes the trainer's final per-tensor checksums and the sync reports as JSON.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

from miles.actors.runtime.host import Host
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import TrainerConfig
from miles.core.schema.transport import TransportConfig
from miles.launch.role import exit_now
from miles.models.hf_io import tensor_checksum
from miles.models.registry import build_model
from miles.trainer.batch import shard_batch
from miles.trainer.dist import leave_process_group
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch
from miles.weightsync.actor_wire import WeightSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sync_helpers import spec  # noqa: E402 - the engines' architecture, shared with the test

# zmq twice: tensor by tensor, then the flat export (rank 0's persistent buffer, byte ranges).
TRANSPORTS = ["zmq", *(["ucx"] if importlib.util.find_spec("ucxx") else []), "broadcast", "disk_delta", "zmq-flat"]


async def push_all(trainer: FSDPTrainer, directory: str, out: Path) -> None:
    host = Host(TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0), directory)
    await host.start()
    reports = []
    try:
        for version, transport in enumerate(TRANSPORTS, start=1):
            flat = transport.endswith("-flat")
            cfg = SyncConfig(transport=transport.removesuffix("-flat"), bucket_mib=1, verify_every=1,  # type: ignore[arg-type]
                             step_timeout_s=30, pause_mode="none", delta_dir=str(out / "deltas"))
            sync = WeightSync(host, cfg, ["e0", "e1"])
            try:
                rep = await sync.push(version, trainer.export_sync_state(flat=True) if flat
                                      else trainer.export_hf_state())
            finally:
                await sync.close()
            reports.append({"transport": transport, "version": version, "committed": rep.committed,
                            "dead": rep.dead, "verified": rep.verified, "buckets": rep.buckets})
    finally:
        await host.stop()
    (out / "reports.json").write_text(json.dumps(reports))


def main() -> None:
    rank, world, port, directory, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    s = spec(hidden=256)  # ~3 MiB: several 1 MiB buckets
    batch = engine_batch(build_model(s, seed=5), groups=4, group_size=2, seed=2)
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.world_size = world
    cfg.micro_batch_tokens = 64
    cfg.optim.lr = 1e-3
    trainer = FSDPTrainer(cfg, s, rank, world, seed=7)
    trainer.train_step(shard_batch(batch, world)[rank])
    if rank == 0:
        asyncio.run(push_all(trainer, directory, out))
    else:
        for transport in TRANSPORTS:  # the export is a collective: drain it once per push of rank 0
            for _ in (trainer.export_sync_state(flat=True) if transport.endswith("-flat") else trainer.export_hf_state()):
                pass
    sums = {k: tensor_checksum(v) for k, v in trainer.export_hf_state()}
    if rank == 0:
        (out / "trainer_checksums.json").write_text(json.dumps(sums))
    # Leave without interpreter teardown: torch's background
    # threads can abort a multi-rank process at exit ("terminate called without an active
    # exception", seen in CI) after every output above is written and closed.
    trainer.close()
    leave_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
