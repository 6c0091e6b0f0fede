"""The megatron backend on one GPU against FSDP2 and the HF layout (skipped without
megatron-core, Python >= 3.12 and CUDA: megatron has no CPU path)."""

from __future__ import annotations

import os

import pytest
import torch

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_state_dict
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.megatron.available import unavailable_reason
from miles.trainer.packing import pack
from miles.trainer.synthetic import engine_batch

WHY = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"megatron backend: {WHY}")]
MOE = tiny_config("qwen3_moe", vocab_size=512, num_hidden_layers=3, mlp_only_layers=[1])
DENSE = tiny_config("qwen2", vocab_size=512, num_hidden_layers=2)


def _make(backend: str, spec: ModelSpec, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.megatron.trainer import MegatronTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    cfg = TrainerConfig()
    cfg.backend = backend  # type: ignore[assignment]
    cfg.device, cfg.param_dtype = "cuda", dtype  # type: ignore[assignment]
    cfg.megatron.transformer_impl = "local"
    cls = MegatronTrainer if backend == "megatron" else FSDPTrainer
    return cls(cfg, spec, 0, 1, seed=5)


@pytest.mark.parametrize("hf", [DENSE, MOE], ids=["qwen2", "qwen3_moe"])
def test_fp32_logprobs_and_loss_match_fsdp(hf: dict) -> None:
    spec = ModelSpec.from_hf(hf)
    batch = engine_batch(build_model(spec, seed=5), groups=2, group_size=3, seed=2)
    f, m = _make("fsdp", spec), _make("megatron", spec)
    mb = pack(batch.samples, list(range(len(batch))), replay=spec.is_moe)
    with torch.no_grad():
        lf = f.forward_model(f.policy, mb.to(f.device), temperature=1.0, replay=spec.is_moe,
                        with_entropy=False).logp.cpu()
    lm = m.forward_micro_batch(mb).logp.cpu()
    assert (lf - lm).abs().max() < 1e-4
    for _ in range(2):  # the second step runs on weights after one AdamW update
        a, b = f.train_step(batch), m.train_step(batch)
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-4
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-3 * a["train/grad_norm"]


def test_bf16_logprobs_within_rounding_of_fsdp() -> None:
    """bf16: FSDP2 runs bf16 parameters, megatron fp32 weights under autocast; both stay
    within bf16 rounding (8 significant bits) of each other: 0.1 nats worst case."""
    spec = ModelSpec.from_hf(MOE)
    batch = engine_batch(build_model(spec, seed=5), groups=2, group_size=3, seed=2)
    f, m = _make("fsdp", spec, "bfloat16"), _make("megatron", spec, "bfloat16")
    mb = pack(batch.samples, list(range(len(batch))), replay=True)
    with torch.no_grad():
        lf = f.forward_model(f.policy, mb.to(f.device), temperature=1.0, replay=True,
                        with_entropy=False).logp.float().cpu()
    lm = m.forward_micro_batch(mb).logp.float().cpu()
    assert (lf - lm).abs().max() < 0.1
    assert (lf - lm).abs().mean() < 0.01
    assert m.train_step(batch)["train/grad_norm"] > 0


def test_r3_replays_recorded_experts_and_export_round_trips() -> None:
    spec = ModelSpec.from_hf(MOE)
    batch = engine_batch(build_model(spec, seed=9), groups=2, group_size=2, seed=4)
    m = _make("megatron", spec)  # other weights than the recorder: live routing differs
    mb = pack(batch.samples, list(range(len(batch))), replay=True)
    m.forward_micro_batch(mb, replay=True)
    used = m.routing.used.cpu().sort(-1).values
    rec = mb.routed_experts.sort(-1).values
    assert torch.equal(used[mb.route_valid], rec[mb.route_valid])
    m.forward_micro_batch(mb, replay=False)
    assert not torch.equal(m.routing.used.cpu().sort(-1).values[mb.route_valid], rec[mb.route_valid])
    want = hf_state_dict(build_model(spec, seed=5))
    got = dict(m.export_hf_state())
    assert set(got) == set(want)
    assert all(torch.equal(got[k].cpu(), want[k]) for k in want)
