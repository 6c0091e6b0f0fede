"""Weight sync under load and faults: generation during a sync, a killed engine, a corrupt delta."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest
import torch

from miles.actors.messages import Generate, Health
from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import checksums
from miles.transport.bulk.buckets import iter_buckets
from miles.transport.bulk.disk_delta import DiskDeltaSender, version_dir
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.messages import BulkOpen, BulkRecv

from .sync_helpers import ENGINE_HOST, client, held, named, perturb, start_engines, trainer_model

pytestmark = pytest.mark.timeout(90)
BIG = ["--hidden", "512", "--layers", "1"]


async def test_every_response_comes_from_one_version(procs) -> None:
    directory = start_engines(procs, n=1)
    host = await client(directory)
    model = trainer_model()
    sync = WeightSync(host, SyncConfig(pause_mode="retract", step_timeout_s=20, verify_every=1), ["e0"])
    responses: list[dict] = []
    stop = asyncio.Event()

    async def probe(i: int) -> None:
        while not stop.is_set():
            msg = Generate([1 + i, 2, 3], {"temperature": 0.0, "max_new_tokens": 24})
            responses.append(await host.ref("e0").ask(msg, timeout=20))

    async def answered_at(version: int) -> None:
        """Until a whole response of `version` is in (the probes keep going meanwhile)."""
        deadline = asyncio.get_running_loop().time() + 30
        while not any(r.versions and r.versions[0] == version for r in responses):
            assert asyncio.get_running_loop().time() < deadline, f"no response at version {version}"
            await asyncio.sleep(0.01)

    try:
        probes = [asyncio.create_task(probe(i)) for i in range(4)]
        for version in (1, 2, 3):
            await answered_at(version - 1)
            perturb(model, seed=version, fraction=1.0)
            rep = await sync.push(version, named(model))
            assert rep.committed == ["e0"] and rep.verified
        await answered_at(3)
        stop.set()
        await asyncio.gather(*probes)
        seen = set()
        for r in responses:
            if r.versions:
                assert len(set(r.versions)) == 1, r.versions  # never a mix of two versions
                seen.add(r.versions[0])
        assert seen == {0, 1, 2, 3}
        assert any(r.retracted for r in responses)  # the probe really overlapped a sync
    finally:
        await sync.close()
        await host.stop()


@pytest.mark.parametrize("transport", ["zmq", "disk_delta"])
async def test_killed_engine_is_reported_and_catches_up(procs, tmp_path, transport) -> None:
    # the directory alone, and both engines started beside it (they import at once; sync_helpers)
    first, first_ready = procs.start([ENGINE_HOST, "--run-directory", *BIG])
    engines = [procs.start([ENGINE_HOST, "--directory-file", first_ready, "--name", n, *BIG]) for n in ("e0", "e1")]
    directory = procs.wait_ready(first, first_ready)
    for p, ready in engines:
        procs.wait_ready(p, ready)
    victim = engines[1][0]
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)
    cfg = SyncConfig(transport=transport, bucket_mib=1, step_timeout_s=15, verify_every=1,
                     delta_dir=str(tmp_path / "d"))
    sync = WeightSync(host, cfg, ["e0", "e1"])

    def killing(after: int) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(named(model)):
            if i == after:
                victim.send_signal(signal.SIGKILL)  # mid-sync: some buckets already went out
                victim.wait(5)
            yield item

    try:
        assert (await sync.push(1, named(model))).committed == ["e0", "e1"]
        perturb(model, seed=2)
        rep = await sync.push(2, killing(after=10))
        assert rep.committed == ["e0"] and rep.dead == ["e1"] and rep.verified
        procs.spawn([ENGINE_HOST, "--directory", directory, "--name", "e1", "--seed", "9", *BIG])
        up = await sync.catch_up("e1", 2, named(model))
        assert up.committed == ["e1"]
        perturb(model, seed=3)
        rep = await sync.push(3, named(model))  # disk_delta: a delta against v2, which e1 now holds
        assert rep.committed == ["e0", "e1"] and rep.dead == [] and rep.verified
        assert await held(host, ["e0", "e1"]) == [checksums(model)] * 2
    finally:
        await sync.close()
        await host.stop()


async def test_corrupt_delta_is_refused(procs, tmp_path) -> None:
    directory = start_engines(procs, n=1)
    host = await client(directory)
    model = trainer_model()
    cfg = SyncConfig(transport="disk_delta", bucket_mib=1, delta_dir=str(tmp_path), step_timeout_s=10,
                     delta_compression="none")
    sync = WeightSync(host, cfg, ["e0"])
    try:
        await sync.push(1, named(model))
        # Write v2 by hand through the same sender (base v1), then flip one byte of it on disk.
        sender = sync.sender
        assert isinstance(sender, DiskDeltaSender)
        perturb(model, seed=5, fraction=1.0)
        headers = []
        for seq, b in enumerate(iter_buckets(named(model), cfg.bucket_mib << 20)):
            headers.append(sender.prepare(2, seq, b))
            await sender.transmit()
        await sender.finish(2)
        blob = version_dir(tmp_path, 2) / "bucket_0.bin"
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x10
        blob.write_bytes(bytes(data))
        e0 = host.ref("e0")
        await e0.ask(BulkOpen("disk_delta", {"dir": str(tmp_path)}, cfg.bucket_mib << 20), timeout=10)
        with pytest.raises(SyncError, match="checksum mismatch.*corrupt delta"):
            await e0.ask(BulkRecv(2, headers[0]), timeout=10)
        assert (await e0.ask(Health(), timeout=10)).version == 1
    finally:
        await sync.close()
        await host.stop()


@pytest.mark.parametrize("transport,fail_at", [("zmq", 0), ("zmq", 9), ("broadcast", 9), ("disk_delta", 9)])
async def test_export_failing_midway_aborts_the_version(procs, tmp_path, transport, fail_at) -> None:
    """The trainer's own export raising mid-push (before any bucket, or at tensor 9 with 5 buckets sent) drops
    the version on every engine: the error reaches the caller as raised, and the next push works."""
    directory = start_engines(procs, n=2, extra=BIG)
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)
    cfg = SyncConfig(transport=transport, bucket_mib=1, step_timeout_s=15, verify_every=1, pause_mode="none",
                     delta_dir=str(tmp_path / "d"))
    sync = WeightSync(host, cfg, ["e0", "e1"])

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(named(model)):
            if i == fail_at:
                raise RuntimeError("all-gather failed on rank 3")
            yield item

    try:
        await sync.push(1, named(model))
        perturb(model, seed=2, fraction=1.0)
        with pytest.raises(RuntimeError, match="all-gather failed"):
            await sync.push(2, broken())
        for e in ("e0", "e1"):
            assert (await host.ref(e).ask(Health(), timeout=10)).version == 1
        rep = await sync.push(3, named(model))  # nothing half-staged blocks the next version
        assert rep.committed == ["e0", "e1"] and rep.verified
        assert await held(host, ["e0", "e1"]) == [checksums(model)] * 2
    finally:
        await sync.close()
        await host.stop()
