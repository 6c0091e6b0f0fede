"""Weight sync under the FP8 contract: buckets carry E4M3 codes + fp32 block scales to engine
processes on FP8 weights; checksums cover codes and scales; about half the bytes of bf16;
the engine installs a version atomically (nothing live changes before the commit)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from miles.core.errors import EngineError
from miles.core.schema.sync import SyncConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.fp8 import SCALE_SUFFIX
from miles.models.fp8_layout import with_fp8
from miles.models.fp8_model import fp8_export
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.weightsync.actor_wire import WeightSync

from .sync_helpers import client, held, perturb

pytestmark = pytest.mark.timeout(90)
HOST = "tests/sync/procs/sync_fp8_engine_host.py"


def _spec(hidden: int, layers: int = 1, block: int = 128) -> ModelSpec:
    cfg = tiny_config("qwen3", vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers)
    return with_fp8(ModelSpec.from_hf(cfg), (block, block))


def _bf16(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's export cast to the sync dtype = the bf16 engines' dtype (sync.dtype)."""
    for n, t in hf_tensor_views(model).items():  # type: ignore[arg-type]
        yield n, t.to(torch.bfloat16)


def _sums(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in named}


@pytest.mark.parametrize("transport", ["zmq", "broadcast"])
async def test_fp8_buckets_reach_fp8_engines_bit_exact_at_half_the_bytes(procs, transport: str) -> None:
    spec = _spec(512)
    _, directory = procs.spawn([HOST, "--run-directory", "--name", "e0", "--hidden", "512"])
    engines = ["e0"]
    if transport == "zmq":  # two engine processes, each with its own copy
        procs.spawn([HOST, "--directory", directory, "--name", "e1", "--hidden", "512", "--seed", "1"])
        engines.append("e1")
    host = await client(directory)
    model = build_model(spec, seed=100)  # the trainer's float masters, fake-quantized forward
    sync = WeightSync(host, SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20), engines)
    try:
        bf16_bytes = sum(t.numel() * 2 for t in hf_tensor_views(model).values())
        for version in (1, 2):
            perturb(model, seed=version)
            sent = [(n, t.clone()) for n, t in fp8_export(_bf16(model), spec)]
            # codes travel as their bytes (uint8): no float8 dtype on the actor wire or in gloo
            assert sum(t.dtype == torch.uint8 for _, t in sent) == sum(n.endswith(SCALE_SUFFIX) for n, _ in sent) == 7
            rep = await sync.push(version, iter(sent))
            # verified: the engines' xxh64 of every code and scale tensor equal the sent ones
            assert rep.committed == engines and rep.verified is True, rep
            assert rep.buckets >= 2  # 1 MiB buckets: the 1 MiB gate_up codes travel alone
            ratio = rep.bytes / bf16_bytes
            assert 0.5 < ratio <= 0.55, ratio
            want = _sums(sent)
            for got in await held(host, engines):
                assert got == want
    finally:
        await sync.close()
        await host.stop()


async def test_float_weights_are_quantized_on_arrival_with_the_same_codes(procs) -> None:
    """An FP8 engine fed plain float weights (a sync without the FP8 hook) quantizes them with
    the shared quantizer: the same codes and scales as the trainer-side conversion."""
    spec = _spec(256)
    _, directory = procs.spawn([HOST, "--run-directory", "--name", "e0", "--hidden", "256"])
    host = await client(directory)
    model = build_model(spec, seed=7)
    sync = WeightSync(host, SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20), ["e0"])
    try:
        rep = await sync.push(1, _bf16(model))
        assert rep.committed == ["e0"]
        want = _sums(list(fp8_export(_bf16(model), spec)))
        assert (await held(host, ["e0"]))[0] == want
    finally:
        await sync.close()
        await host.stop()


async def test_fp8_version_installs_atomically() -> None:
    spec = _spec(64, layers=2, block=32)
    engine = TorchEngine(build_model(spec, seed=1))
    trainer = build_model(spec, seed=2)
    try:
        before = engine.checksums()
        ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
        old = engine.model(ids).logits  # fills the CPU engine's cache of dequantized weights
        sent = list(fp8_export(hf_tensor_views(trainer).items(), spec))
        half = len(sent) // 2
        await engine.stage(5, sent[:half])
        await engine.stage(5, sent[half:])
        assert engine.checksums() == before  # staged, not live
        assert torch.equal(engine.model(ids).logits, old)
        await engine.commit(5)
        assert engine.checksums() == _sums(sent)
        assert not torch.equal(engine.model(ids).logits, old)  # the cached old weights are gone
        assert torch.equal(engine.model(ids).logits, trainer(ids).logits)  # the contract after a sync
        # a half-staged version never goes live; a scale of the wrong grid is refused
        await engine.stage(6, [sent[0]])
        with pytest.raises(EngineError, match="not staged"):
            await engine.commit(6)
        await engine.abort_version(6)
        assert engine.checksums() == _sums(sent)
        name = next(n for n, _ in sent if n.endswith(SCALE_SUFFIX))
        with pytest.raises(EngineError, match="shape"):
            await engine.stage(7, [(name, torch.ones(1, 1))])
    finally:
        await engine.close()
