"""Offload of the whole trainer state as one block: bit-identical training, memory released."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import TrainerError
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.offload import FlatOffload
from miles.trainer.synthetic import engine_batch


class WrappedTrainer(FSDPTrainer):
    wrap_single_rank = True  # FSDP2 at one rank: its padded flat shards alias the parameters


TRAINERS = [FSDPTrainer, WrappedTrainer]  # one fp32 rank is plain modules by default


def _cfg() -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40
    cfg.optim.lr = 1e-3
    cfg.loss.kl_coef = 0.01  # a reference model too
    cfg.deterministic = True
    return cfg


def _state(t: FSDPTrainer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in t.export_hf_state()}
    for i, st in enumerate(t.opt.state.values()):
        for k, v in st.items():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"opt.{i}.{k}"] = v.detach().clone()
    return out


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_offload_cycles_are_bit_identical(arch: str, trainer: type[FSDPTrainer]) -> None:
    spec = ModelSpec.from_hf(tiny_config(arch, vocab_size=64, num_hidden_layers=1))
    # two steps: the first offloads before the optimizer has state, the second with it (a third
    # repeated the second's cycle)
    batches = [
        engine_batch(build_model(spec, seed=2), groups=2, group_size=2, seed=s) for s in range(2)
    ]
    plain = trainer(_cfg(), spec, 0, 1, seed=2)
    cycled = trainer(_cfg(), spec, 0, 1, seed=2)
    cycled.offload()  # before the optimizer has any state
    cycled.reload()
    for b in batches:
        want = plain.train_step(b)
        cycled.offload()
        assert cycled.offloaded
        got = cycled.train_step(b)  # reloads by itself
        assert not cycled.offloaded
        assert got["train/loss"] == want["train/loss"]
        assert got["train/grad_norm"] == want["train/grad_norm"]
        cycled.offload()
        cycled.reload()
    a, b2 = _state(plain), _state(cycled)
    assert a.keys() == b2.keys() and any(k.startswith("opt.") for k in a)
    for k in a:
        assert torch.equal(a[k], b2[k]), k


@pytest.mark.parametrize("trainer", TRAINERS)
def test_offload_releases_device_memory(trainer: type[FSDPTrainer]) -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    t = trainer(_cfg(), spec, 0, 1, seed=0)
    t.train_step(engine_batch(build_model(spec, seed=0), groups=1, group_size=2, seed=0))
    assert t._offload.block is None
    t.offload()
    off = t._offload.block
    assert off is not None and off.nbytes > 0
    params = [p.to_local() if hasattr(p, "to_local") else p for p in t.trainable.parameters()]
    # every parameter is a view of the one block, whose memory is released
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(p.grad is None for p in t.trainable.parameters())
    with pytest.raises(TrainerError, match="twice"):
        t.offload()
    t.reload()
    assert all(p.untyped_storage().nbytes() == off.nbytes for p in params)
    with pytest.raises(TrainerError, match="on the device"):
        t.reload()


def test_unknown_alias_is_refused() -> None:
    a = torch.arange(8, dtype=torch.float32)
    alias = a[2:]  # not handed to FlatOffload and not an autograd view of it
    alias_outside = torch.empty(0).set_(a.untyped_storage(), 2, (6,), (1,))
    del alias
    fo = FlatOffload(lambda: [a], torch.device("cpu"))
    with pytest.raises(TrainerError, match="outside the set"):
        fo.offload()
    assert alias_outside.sum() == sum(range(2, 8))
