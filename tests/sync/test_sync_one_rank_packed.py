"""Tensor-by-tensor exports packed into one flat buffer and pushed as a one-rank sharded sync.

`GatheredSync` packs an export that is not a `FlatWeights` (one copy on the trainer) when its
channel goes one-rank (zmq, ucx, broadcast from a CPU trainer): a LoRA adapter payload lands in slots the torch engine sets
aside for it from the plan (weightsync/stager.py `set_aside`), then merges as a tensor push
would. Checked with real engine processes: the engines hold the adapters as sent and the
merged weights the trainer computes, bit for bit.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import LoraConfig
from miles.models.hf_io import tensor_checksum
from miles.trainer.lora import apply_lora, iter_adapter_payload, iter_merged_hf_state
from miles.weightsync.actor_wire import WeightSync

from .sync_helpers import ENGINE_HOST, client, held, trainer_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", ["zmq", "broadcast", *(["ucx"] if importlib.util.find_spec("ucxx") else [])])
async def test_a_lora_adapter_payload_goes_one_rank_and_merges_bit_exact(procs, transport: str) -> None:
    # both engines hold the trainer's base weights (seed 100): adapters merge onto them
    args = ["--seed", "100", "--hidden", "128", "--layers", "2"]
    _, directory = procs.spawn([ENGINE_HOST, "--run-directory", "--name", "e0", *args])
    procs.spawn([ENGINE_HOST, "--directory", directory, "--name", "e1", *args])
    engines = ["e0", "e1"]
    host = await client(directory)
    model = trainer_model(hidden=128, layers=2)
    lcfg = LoraConfig(rank=4, alpha=8.0)
    apply_lora(model, lcfg, seed=1)
    cfg: Any = SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20)  # type: ignore[arg-type]
    sync = WeightSync(host, cfg, engines)
    try:
        for version in (1, 2):
            with torch.no_grad():  # a training step moves the adapters (B starts at zero)
                for n, p in model.named_parameters():
                    if ".lora_" in n:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
            sent = [(n, t.clone()) for n, t in iter_adapter_payload(model, lcfg)]
            payload = sum(t.numel() * t.element_size() for _, t in sent)
            rep = await sync.push(version, iter(sent))
            assert rep.committed == engines and rep.verified is True and rep.declined == [], rep
            assert rep.full_bytes == rep.bytes == payload, rep  # one copy of the adapters, pushed one-rank
            want = {n: tensor_checksum(t) for n, t in iter_merged_hf_state(model)}
            want.update((n, tensor_checksum(t)) for n, t in sent)
            assert await held(host, engines) == [want, want]
    finally:
        await sync.close()
        await host.stop()
