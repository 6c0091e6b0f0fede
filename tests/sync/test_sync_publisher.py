"""The trainer's weight hand-off (weightsync/publisher.py) against real engine processes.

The exporter is the FSDP trainer's own flat export buffer (weightsync/flat_export.py) over a
real fp32 model; the engines are real torch engines in bf16 or fp32 over zmq.
"""

from __future__ import annotations

import pytest
import structlog
import torch

from miles.core.config import load_config
from miles.core.schema import MilesConfig
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.flat import FlatWeights
from miles.weightsync.flat_export import FlatExportBuffer
from miles.weightsync.publisher import WeightPublisher

from .sync_helpers import ENGINE_HOST, client, held, perturb, start_engines, trainer_model

pytestmark = pytest.mark.timeout(90)
SHAPE = ["--hidden", "512", "--layers", "1"]


class FlatExporter:
    """What the FSDP trainer's export_sync_state does on one rank: the HF weights, gathered into
    a persistent flat buffer in the wire dtype (or streamed tensor by tensor)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.buf = FlatExportBuffer()

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None):  # noqa: ANN201
        named = hf_tensor_views(self.model).items()
        return self.buf.fill(named, dtype) if flat else iter(list(named))


def _expected(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    return {n: tensor_checksum(t.to(dtype)) for n, t in hf_tensor_views(model).items()}


async def _announce() -> None:
    return None


def test_wire_dtype_defaults_to_the_engines() -> None:
    cfg = load_config(MilesConfig, None, ["engine.dtype=bfloat16", "trainer.device=cpu"])
    assert cfg.sync.dtype == "bfloat16"  # an fp32 trainer sends a bf16 engine bf16
    assert load_config(MilesConfig, None, ["sync.dtype=same"]).sync.dtype == "same"
    lora = load_config(MilesConfig, None, ["engine.dtype=bfloat16", "trainer.lora.rank=4"])
    assert lora.sync.dtype == "same"  # adapters travel as exported: the engine merges them


async def test_fp32_trainer_sends_a_bf16_engine_bf16_on_the_flat_path(procs) -> None:
    directory = start_engines(procs, n=1, extra=[*SHAPE, "--dtype", "bfloat16"])
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)
    cfg = SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20, dtype="bfloat16")
    pub = WeightPublisher(cfg, FlatExporter(model), WeightSync(host, cfg, ["e0"]))
    try:
        for version in (1, 2):
            perturb(model, seed=version)
            m = await pub.hand_off(version, _announce)
            assert m["sync/plan_declined"] == 0
            fp32_bytes = sum(t.numel() * 4 for t in hf_tensor_views(model).values())
            assert m["sync/payload_bytes"] == m["sync/bytes"] == fp32_bytes // 2
            assert await held(host, ["e0"]) == [_expected(model, torch.bfloat16)]
            assert m["perf/sync_s"] >= m["perf/push_s"] >= m["perf/transfer_s"] > 0
    finally:
        await pub.sync.close()  # type: ignore[union-attr]
        await host.stop()


async def test_a_declined_plan_is_logged_with_its_reason_and_counted(procs) -> None:
    directory = start_engines(procs, n=1, extra=[*SHAPE, "--dtype", "bfloat16"])
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)
    cfg = SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20, dtype="same")  # fp32 on the wire
    pub = WeightPublisher(cfg, FlatExporter(model), WeightSync(host, cfg, ["e0"]))
    try:
        with structlog.testing.capture_logs() as logs:
            m = await pub.hand_off(1, _announce)
        assert m["sync/plan_declined"] == 1
        warn = [e for e in logs if e["event"] == "flat_plan_declined"]
        assert warn and warn[0]["log_level"] == "warning", logs
        assert "float32" in warn[0]["engines"]["e0"] and "bfloat16" in warn[0]["engines"]["e0"], warn
        assert "sync.dtype" in warn[0]["consequence"], warn  # a dtype mismatch: the advice that fixes it
        assert await held(host, ["e0"]) == [_expected(model, torch.bfloat16)]  # tensors went, converted
    finally:
        await pub.sync.close()  # type: ignore[union-attr]
        await host.stop()


@pytest.mark.parametrize("source", ["export_buffer", "host_copy"])
async def test_catch_up_needs_no_host_copy_on_the_push_path(procs, source: str) -> None:
    """export_buffer: a catch-up sends from the export buffer itself (no copy at all);
    host_copy: the copy is made after the push, in the background. Either way a late engine
    is brought to the last pushed version, bit for bit."""
    directory = start_engines(procs, n=1, extra=SHAPE)
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)
    exporter = FlatExporter(model)
    cfg = SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20, catchup_source=source)  # type: ignore[arg-type]
    pub = WeightPublisher(cfg, exporter, WeightSync(host, cfg, ["e0"]))
    try:
        for version in (1, 2):
            perturb(model, seed=version)
            await pub.hand_off(version, _announce)
            buf = exporter.buf.weights
            assert buf is not None
            if source == "export_buffer":
                assert pub._copy is None  # nothing was copied for catch-ups, now or in the background
            got = await pub.source()
            assert got is not None and got[0] == version
            src = got[1]
            assert isinstance(src, FlatWeights)
            same_storage = src.buffer.data_ptr() == buf.buffer.data_ptr()
            assert same_storage == (source == "export_buffer")
            assert torch.equal(src.buffer, buf.buffer)
        procs.spawn([ENGINE_HOST, "--directory", directory, "--name", "e1", "--seed", "7", *SHAPE])
        assert await pub.catch_up("e1")
        want = _expected(model, torch.float32)
        assert await held(host, ["e0", "e1"]) == [want, want]
        # The late engine is in the set now: the next version reaches both.
        perturb(model, seed=3)
        await pub.hand_off(3, _announce)
        want = _expected(model, torch.float32)
        assert await held(host, ["e0", "e1"]) == [want, want]
    finally:
        await pub.sync.close()  # type: ignore[union-attr]
        await host.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (H200 runs)")
def test_host_copy_of_a_cuda_export_is_pinned_and_exact() -> None:
    """host_copy mode on a GPU trainer: the copy is made on a side stream into pinned memory,
    ordered after the export's fill, and reused (no new allocation) for the next version."""
    from miles.weightsync.publisher import _host_copy

    model = trainer_model(hidden=512, layers=1).cuda()
    exporter = FlatExporter(model)
    fw = exporter.export_sync_state(flat=True, dtype=torch.bfloat16)
    first = _host_copy(fw, None)
    assert first.buffer.is_pinned() and torch.equal(first.buffer, fw.buffer.cpu())
    perturb(model, seed=9)
    fw = exporter.export_sync_state(flat=True, dtype=torch.bfloat16)
    second = _host_copy(fw, first.buffer)
    assert second.buffer.data_ptr() == first.buffer.data_ptr() and torch.equal(second.buffer, fw.buffer.cpu())
