"""The channels that need optional pieces: ucx (UCXX) and cuda_ipc (a CUDA GPU shared by trainer and engine),
and the GPU paths of the others (a CUDA trainer's flat export to CUDA engines)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import checksums
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.trainer_sync import ONE_RANK_TRANSPORTS

from .sync_helpers import ENGINE_HOST, client, held, named, perturb, start_engines, trainer_model

pytestmark = pytest.mark.timeout(90)
HAS_UCXX = importlib.util.find_spec("ucxx") is not None
NO_UCXX = "ucxx is not installed: the `ucx` extra (ucxx-cu12) needs CUDA libraries (rmm, cuda-core)"
NO_CUDA = "cuda_ipc needs a CUDA GPU shared by trainer and engine; this machine has none"


@pytest.mark.skipif(HAS_UCXX, reason="ucxx is installed here; the missing-package error cannot be shown")
async def test_ucx_without_ucxx_says_how_to_get_it() -> None:
    from miles.transport.bulk.base import make_receiver, make_sender

    with pytest.raises(SyncError, match=r"miles\[ucx\]"):
        make_sender(SyncConfig(transport="ucx"))
    with pytest.raises(SyncError, match=r"miles\[ucx\]"):
        make_receiver("ucx", {"addr": "127.0.0.1", "port": 1, "index": 0}, 1 << 20)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available; the no-GPU error cannot be shown")
def test_cuda_ipc_without_cuda_is_a_clear_error() -> None:
    from miles.transport.bulk.base import make_sender

    with pytest.raises(SyncError, match="needs CUDA"):
        make_sender(SyncConfig(transport="cuda_ipc"))


async def _sync_two_versions(procs, transport: str, device: str) -> None:
    directory = start_engines(procs, extra=["--device", device])
    host = await client(directory)
    model = trainer_model().to(device)
    sync = WeightSync(host, SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20),
                      ["e0", "e1"])
    try:
        for version in (1, 2):
            perturb(model, seed=version)
            rep = await sync.push(version, named(model))
            assert rep.committed == ["e0", "e1"] and rep.verified
            assert await held(host, ["e0", "e1"]) == [checksums(model)] * 2
    finally:
        await sync.close()
        await host.stop()


@pytest.mark.skipif(not HAS_UCXX, reason=NO_UCXX)
async def test_ucx_sync_is_bit_equal(procs) -> None:
    await _sync_two_versions(procs, "ucx", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_cuda_ipc_sync_is_bit_equal(procs) -> None:
    await _sync_two_versions(procs, "cuda_ipc", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_cuda_ipc_flat_sync_is_bit_equal(procs) -> None:
    """A flat export over cuda_ipc: the buffer is mapped once and kept across versions; a new
    buffer (re-packed) and a re-opened channel are shared afresh; tensor pushes still mix in."""
    from miles.models.hf_io import hf_tensor_views
    from miles.weightsync.flat import FlatWeights
    from miles.weightsync.param_buffer import pack_parameters

    directory = start_engines(procs, extra=["--device", "cuda"])
    host = await client(directory)
    model = trainer_model().to("cuda")
    pack_parameters(list(model.parameters()))
    engines = ["e0", "e1"]
    sync = WeightSync(host, SyncConfig(transport="cuda_ipc", bucket_mib=1, verify_every=1, step_timeout_s=20),
                      engines)
    try:
        for version in (1, 2, 3, 4, 5):
            if version == 3:
                pack_parameters(list(model.parameters()))  # a new buffer: a new share id
            if version == 4:
                sync._forget()  # the channel is re-opened: receivers map the buffer afresh
            perturb(model, seed=version)
            state = hf_tensor_views(model).items()
            rep = await sync.push(version, state if version == 5 else FlatWeights.of(state))
            assert rep.committed == engines and rep.verified, (version, rep)
            assert await held(host, engines) == [checksums(model)] * 2, version
    finally:
        await sync.close()
        await host.stop()


_FRESH_PROCESS_MAPS = """
import sys, msgspec, torch
from miles.transport.bulk.base import LocalWeights
from miles.transport.bulk.cuda_ipc import CudaIpcReceiver
header = msgspec.msgpack.decode(sys.stdin.buffer.read())
assert not torch.cuda.is_initialized()  # the mapping is this process's first CUDA call
rx = CudaIpcReceiver({"device": 0}, 1 << 20)
import asyncio
out = asyncio.run(rx.recv(header, LocalWeights(version=0, get=lambda n: None)))
asyncio.run(rx.settle())
print(sum(float(t.double().sum()) for _, t in out))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_ipc_maps_in_a_process_that_never_touched_cuda() -> None:
    """An SGLang engine role runs no model, so the receiver's mapping is its first CUDA call; the
    receiver initialises CUDA itself (without it, that process died of SIGSEGV in session 17)."""
    import subprocess
    import sys

    import msgspec

    from miles.transport.bulk.buckets import Bucket
    from miles.transport.bulk.cuda_ipc import CudaIpcSender

    a = torch.arange(256, dtype=torch.float32, device="cuda")
    b = torch.ones(64, dtype=torch.bfloat16, device="cuda")
    tx = CudaIpcSender(SyncConfig(transport="cuda_ipc"))
    header = tx.prepare(1, 0, Bucket(["a", "b"], [a, b], a.nbytes + b.nbytes))
    child = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_MAPS], input=msgspec.msgpack.encode(header),
                           capture_output=True, timeout=60)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert float(child.stdout.decode().split()[-1]) == float(a.sum() + b.float().sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the trainer and the engines")
@pytest.mark.parametrize("transport", ["zmq", "broadcast", *(["ucx"] if HAS_UCXX else [])])
async def test_a_cuda_flat_export_reaches_cuda_engines_bit_equal(procs, transport: str) -> None:
    """A CUDA trainer's flat export to CUDA engines: over zmq and ucx a one-rank sharded sync
    (weightsync/one_rank.py; ucx lands GPU to GPU), over broadcast NCCL's collective; then a
    tensor-by-tensor push on the same channel (the gathered coordinator), and the flat export again."""
    from miles.models.hf_io import hf_tensor_views
    from miles.weightsync.flat import FlatWeights
    from miles.weightsync.param_buffer import pack_parameters

    if transport == "broadcast":
        if torch.cuda.device_count() < 3:
            pytest.skip(f"broadcast needs a GPU per member (the trainer and each of 2 engines; NCCL cannot place two "
                        f"ranks of one group on one GPU); this machine has {torch.cuda.device_count()}")
        directory = _engines_on_gpus_of_their_own(procs)
    else:
        directory = start_engines(procs, extra=["--device", "cuda"])
    host = await client(directory)
    model = trainer_model().to("cuda")
    pack_parameters(list(model.parameters()))
    engines = ["e0", "e1"]
    sync = WeightSync(host, SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=30),  # type: ignore[arg-type]
                      engines, device="cuda")
    try:
        for version in (1, 2, 3, 4):
            perturb(model, seed=version)
            state = hf_tensor_views(model).items()
            rep = await sync.push(version, state if version == 3 else FlatWeights.of(state))
            assert rep.committed == engines and rep.verified, (version, rep)
            assert (rep.full_bytes > 0) == (version != 3 and transport in ONE_RANK_TRANSPORTS), (version, rep)
            assert await held(host, engines) == [checksums(model)] * 2, version
    finally:
        await sync.close()
        await host.stop()


def _engines_on_gpus_of_their_own(procs) -> str:
    """e0 on this process's cuda:1 and e1 on its cuda:2 (each process sees only its own GPU, as
    `cuda`), while the trainer here uses cuda:0; returns the directory's address."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    args = [ENGINE_HOST, "--device", "cuda"]
    first, first_ready = procs.start([*args, "--run-directory", "--name", "e0", "--seed", "0"],
                                     env={"CUDA_VISIBLE_DEVICES": gpus[1]})
    second, second_ready = procs.start([*args, "--directory-file", first_ready, "--name", "e1", "--seed", "1"],
                                       env={"CUDA_VISIBLE_DEVICES": gpus[2]})
    directory = procs.wait_ready(first, first_ready)
    procs.wait_ready(second, second_ready)
    return directory
