"""disk_delta keeps its working memory across versions: the sender's copies of the last version
(and their spares), the receiver's read buffer. Versions after an abort and after a base reset
still rebuild the trainer's bytes exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import LocalWeights
from miles.transport.bulk.buckets import iter_buckets
from miles.transport.bulk.disk_delta import DiskDeltaReceiver, DiskDeltaSender, version_dir

pytestmark = pytest.mark.timeout(60)
BUCKET = 1 << 12


class Side:
    """A sender and one engine's receiver over a directory, the engine's weights as a dict."""

    def __init__(self, root: Path, weights: dict[str, torch.Tensor], bucket: int = BUCKET) -> None:
        self.snd = DiskDeltaSender(SyncConfig(transport="disk_delta", bucket_mib=1, delta_dir=str(root)))
        asyncio.run(self.snd.open(["e"]))
        self.bucket = bucket  # no tensor here is larger: none is chunked (`live` holds whole tensors)
        self.rcv = DiskDeltaReceiver({"dir": str(root)}, bucket)
        self.live = {k: torch.zeros_like(v) for k, v in weights.items()}
        self.version = 0

    def write(self, v: int, weights: dict[str, torch.Tensor]) -> int:
        n = 0
        for seq, b in enumerate(iter_buckets(weights.items(), self.bucket)):
            self.snd.prepare(v, seq, b)
            asyncio.run(self.snd.transmit())
            n += 1
        asyncio.run(self.snd.finish(v))
        return n

    def push(self, v: int, weights: dict[str, torch.Tensor]) -> list[dict]:
        n = self.write(v, weights)
        local = LocalWeights(self.version, lambda k: self.live[k])
        got = [x for seq in range(n) for x in self.rcv._recv(v, seq, local)]
        for name, t in got:
            self.live[name] = t.clone()
        asyncio.run(self.snd.committed(v))
        self.version = v
        return [e for b in self.rcv._load_index(v)["buckets"].values() for e in b]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64 + 16 * i, generator=g) for i in range(6)}


def test_buffers_are_reused_and_unchanged_entries_cost_no_copy(tmp_path: Path) -> None:
    w = _weights()
    side = Side(tmp_path, w)
    side.push(1, w)
    first = {k: t.data_ptr() for k, t in side.snd._last.items()}
    w["w1"] += 1.0
    enc = {e["name"]: e["encoding"] for e in side.push(2, w)}
    assert enc["w1"].startswith("xor") and {v for k, v in enc.items() if k != "w1"} == {"same"}
    assert side.snd._last["w0"].data_ptr() == first["w0"]  # unchanged: the same buffer, not copied again
    assert side.snd._last["w1"].data_ptr() != first["w1"]  # changed: written into the spare
    spare = side.snd._spare["w1"].data_ptr()
    assert spare == first["w1"]  # v1's buffer is now the spare
    w["w1"] += 1.0
    side.push(3, w)
    assert side.snd._last["w1"].data_ptr() == spare  # and v3 lands in it: no new memory per version
    for k in w:
        assert torch.equal(side.live[k], w[k]), k


def test_an_aborted_version_leaves_the_base_and_the_next_delta_exact(tmp_path: Path) -> None:
    w = _weights()
    side = Side(tmp_path, w)
    side.push(1, w)
    w["w2"] -= 0.5
    side.write(2, w)
    asyncio.run(side.snd.abort(2))  # e.g. an engine died mid-push: v2 never commits
    assert side.snd.base_version == 1  # v3 is a delta against v1, which the engine holds
    w["w3"] *= 2.0
    enc = {e["name"]: e["encoding"] for e in side.push(3, w)}
    assert enc["w2"].startswith("xor") and enc["w3"].startswith("xor") and enc["w0"] == "same"
    for k in w:
        assert torch.equal(side.live[k], w[k]), k
    side.snd.reset_base()  # engines restarted: the next version is written in full
    side.live = {k: torch.zeros_like(v) for k, v in w.items()}
    enc = {e["name"]: e["encoding"] for e in side.push(4, w)}
    assert all(v.startswith("full") for v in enc.values())
    for k in w:
        assert torch.equal(side.live[k], w[k]), k


def test_a_corrupt_delta_is_refused_after_the_read_buffer_was_reused(tmp_path: Path) -> None:
    w = _weights()
    side = Side(tmp_path, w)
    side.push(1, w)
    w["w5"] += 1.0
    side.write(2, w)
    idx = side.rcv._load_index(2)
    seq, entry = next((s, e) for s, b in idx["buckets"].items() for e in b if e["name"] == "w5")
    path = version_dir(tmp_path, 2) / f"bucket_{seq}.bin"
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(SyncError, match="checksum mismatch"):
        side.rcv._recv(2, int(seq), LocalWeights(1, lambda k: side.live[k]))


def _large() -> dict[str, torch.Tensor]:
    """Tensors past the compression sample (64 KiB) and the receiver's 1 MiB read chunk: a dense
    random change of them goes uncompressed (`full+raw`), read from the file straight into place."""
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(300_000, generator=g), "small": torch.randn(64, generator=g)}


def test_uncompressed_entries_are_read_in_place_and_checked(tmp_path: Path) -> None:
    w = _large()
    side = Side(tmp_path, w, bucket=2 << 20)
    side.push(1, w)
    w["big"] += torch.randn(w["big"].shape, generator=torch.Generator().manual_seed(2))
    enc = {e["name"]: e["encoding"] for e in side.push(2, w)}
    assert enc == {"big": "full+raw", "small": "same"}
    assert torch.equal(side.live["big"], w["big"]) and torch.equal(side.live["small"], w["small"])
    # the receiver's read buffer was not needed for them: it holds at most the compressed payloads
    assert side.rcv._buf.numel() < w["big"].numel() * 4

    w["big"] -= 0.25
    side.write(3, w)
    idx = side.rcv._load_index(3)
    seq, entry = next((s, e) for s, b in idx["buckets"].items() for e in b if e["name"] == "big")
    assert entry["encoding"] == "full+raw"
    path = version_dir(tmp_path, 3) / f"bucket_{seq}.bin"
    data = bytearray(path.read_bytes())
    data[entry["offset"] + (1 << 20) + 5] ^= 0x01  # in the second read chunk
    path.write_bytes(bytes(data))
    with pytest.raises(SyncError, match="checksum mismatch"):
        side.rcv._recv(3, int(seq), LocalWeights(2, lambda k: side.live[k]))
    path.write_bytes(bytes(data[: entry["offset"] + 100]))  # cut short inside the entry
    with pytest.raises(SyncError, match="runs past the end"):
        side.rcv._recv(3, int(seq), LocalWeights(2, lambda k: side.live[k]))


def test_versions_past_delta_keep_are_deleted(tmp_path: Path) -> None:
    w = _weights()
    side = Side(tmp_path, w)
    for v in range(1, 6):
        w["w0"] += 1.0
        side.push(v, w)
    asyncio.run(side.snd.close())  # waits for the last delete, which runs beside the next push
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weight_v4", "weight_v5"]  # sync.delta_keep = 2


def test_a_failed_bucket_write_fails_the_push_and_abort_recovers(tmp_path: Path) -> None:
    """Bucket files are written on a writer thread after `transmit` returns: a write that fails
    (here: its directory is gone) fails `finish` (or the next `transmit`), and after `abort` the
    next version is still an exact delta against the committed base."""
    import shutil

    w = _weights()
    side = Side(tmp_path, w)
    side.push(1, w)
    w["w4"] += 1.0
    buckets = list(iter_buckets(w.items(), BUCKET))
    side.snd.prepare(2, 0, buckets[0])
    assert side.snd._tmp is not None
    shutil.rmtree(side.snd._tmp)  # fault injection: the version's directory vanished
    asyncio.run(side.snd.transmit())  # returns once queued
    with pytest.raises(FileNotFoundError):
        asyncio.run(side.snd.finish(2))
    asyncio.run(side.snd.abort(2))
    enc = {e["name"]: e["encoding"] for e in side.push(3, w)}
    assert enc["w4"].startswith("xor") and enc["w0"] == "same"
    for k in w:
        assert torch.equal(side.live[k], w[k]), k


def test_the_next_bucket_is_read_ahead_and_an_unexpected_ask_still_gets_its_own(tmp_path: Path) -> None:
    """`recv` of bucket k starts reading bucket k+1 into place; the next ask takes it (a corrupt
    one still raises there), and an ask for another bucket waits for it and reads its own."""
    w = _weights()
    side = Side(tmp_path, w, bucket=1024)  # a bucket per one or two tensors
    side.push(1, w)
    for k in w:
        w[k] += 0.5
    n = side.write(2, w)
    assert n >= 3
    local = LocalWeights(1, lambda k: side.live[k])

    async def asks(order: list[int]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for seq in order:
            got.update((name, t.clone()) for name, t in await side.rcv.recv({"version": 2, "seq": seq}, local))
            if seq == order[0]:
                assert side.rcv._ahead is not None and side.rcv._ahead[:2] == (2, seq + 1)
        await side.rcv.settle()
        assert side.rcv._ahead is None
        return got

    for order in (list(range(n)), [0, 2, 1, *range(3, n)]):
        got = asyncio.run(asks(order))
        assert set(got) == set(w)
        for k in w:
            assert torch.equal(got[k], w[k]), k
    idx = side.rcv._load_index(2)
    entry = idx["buckets"]["1"][0]
    path = version_dir(tmp_path, 2) / "bucket_1.bin"
    data = bytearray(path.read_bytes())
    data[entry["offset"]] ^= 0x10
    path.write_bytes(bytes(data))

    async def corrupt() -> None:
        await side.rcv.recv({"version": 2, "seq": 0}, local)  # reads bucket 1 ahead: it fails there
        with pytest.raises(SyncError, match="checksum mismatch|corrupt delta"):
            await side.rcv.recv({"version": 2, "seq": 1}, local)

    asyncio.run(corrupt())
    asyncio.run(side.rcv.close())
