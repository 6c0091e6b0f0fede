"""trainer.recompute: activation checkpointing keeps less for the backward and changes no
gradient, for dense and MoE blocks, in a plain model and in an FSDP2-wrapped trainer."""

from __future__ import annotations

import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(120)


def _spec(arch: str) -> ModelSpec:
    return ModelSpec.from_hf(tiny_config(arch, vocab_size=64))


def _grads(arch: str, mode: str, layers: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of a packed forward's weighted logprob sum, and the bytes autograd saved."""
    spec = _spec(arch)
    model = build_model(spec, seed=0)
    model.set_recompute(mode, layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (1, 40), generator=g)
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    idx = torch.arange(0, 39)
    w = torch.randn(39, generator=g)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, cu_seqlens=cu, logits_index=idx, target_ids=ids[0, 1:], return_routed_experts=spec.is_moe)
    assert out.logprobs is not None
    (out.logprobs * w).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_recompute_keeps_less_and_changes_no_gradient(arch: str) -> None:
    ref, off = _grads(arch, "off")
    for mode, layers in (("mlp", 0), ("full", 0), ("full", 1)):
        got, saved = _grads(arch, mode, layers)
        assert got.keys() == ref.keys()
        for name, gr in ref.items():
            torch.testing.assert_close(got[name], gr, rtol=0, atol=0, msg=f"{mode}/{layers}: {name}")
        assert saved < off, f"{mode}/{layers} saved {saved} bytes for the backward, off saved {off}"
    assert _grads(arch, "full")[1] < _grads(arch, "full", 1)[1] < off  # fewer blocks, more kept
    assert _grads(arch, "full")[1] < _grads(arch, "mlp")[1]


def test_fsdp_trainer_step_is_unchanged_by_recompute() -> None:
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.sharding import is_dtensor

    spec = _spec("qwen3_moe")
    batch = engine_batch(build_model(spec, seed=0), groups=2, group_size=2, prompt_len=(4, 6), response_len=(5, 9))
    params, losses = {}, {}
    for mode in ("off", "full"):
        cfg = TrainerConfig()
        cfg.param_dtype = "bfloat16"  # one rank in bf16: FSDP2-wrapped, DTensor parameters
        cfg.recompute = mode  # type: ignore[assignment]
        cfg.routing_replay = True
        cfg.optim.lr = 1e-3
        t = FSDPTrainer(cfg, spec, 0, 1, seed=0)
        try:
            assert is_dtensor(next(t.policy.parameters()))
            losses[mode] = t.train_step(batch)["train/loss"]
            params[mode] = [(p.full_tensor() if is_dtensor(p) else p).detach().clone() for p in t.policy.parameters()]
        finally:
            t.close()
    assert losses["full"] == losses["off"]
    for a, b in zip(params["off"], params["full"], strict=True):
        assert torch.equal(a, b)


def test_bad_recompute_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="trainer.recompute"):  # the loader enforces the Literal
        load_config(MilesConfig, None, ["trainer.recompute=some"])
    with pytest.raises(ConfigError, match="recompute_layers=-1"):
        load_config(MilesConfig, None, ["trainer.recompute_layers=-1"])
    with pytest.raises(ModelInputError, match="recompute layers"):
        build_model(_spec("qwen3"), seed=0).set_recompute("mlp", -1)
