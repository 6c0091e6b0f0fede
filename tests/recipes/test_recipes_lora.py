"""LoRA RL: only adapters train and sync; the engine re-merges them and agrees with the trainer."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.lora import LoraMerger
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.models.lora import SCALE_NAME
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer

from .rl_loop import prompts, rollout, to_batch

SPEC = ModelSpec.from_hf(
    tiny_config("qwen3", vocab_size=64, num_hidden_layers=2, initializer_range=0.1)
)


async def test_adapter_sync_and_logprob_agreement() -> None:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 128
    cfg.optim.lr = 2e-2
    cfg.lora.rank = 4
    cfg.lora.alpha = 8.0
    trainer = FSDPTrainer(cfg, SPEC, 0, 1, seed=4)
    base = build_model(SPEC, seed=4)  # the same init the trainer's policy got
    engine = TorchEngine(build_model(SPEC, seed=4), EngineConfig(max_batch_size=16))
    merger = LoraMerger(engine, cfg.lora.alpha / cfg.lora.rank)
    trainable = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    try:
        diffs = []
        for step in range(3):
            ps = prompts(SPEC.vocab_size, 3, seed=step)
            res = await rollout(engine, ps, 4, run_seed=2, step=step, max_new=6)
            m = trainer.train_step(to_batch(ps, res, 4))
            diffs.append(m["train/train_rollout_logprob_abs_diff_max"])
            adapters = dict(trainer.export_lora_state())
            assert all(k.endswith((".lora_A", ".lora_B")) for k in adapters)
            sent = sum(v.numel() * v.element_size() for v in adapters.values())
            assert 0 < sent < full_bytes / 5  # only adapter bytes move
            assert await merger.apply(step + 1, adapters) == 4 * SPEC.num_layers
        # every rollout ran on the trainer's current effective weights
        assert max(diffs) < 1e-5
        # the engine now holds exactly the trainer's merged weights
        merged = dict(trainer.export_hf_state())
        eng = engine.state_dict_hf()
        assert merged.keys() == eng.keys()
        assert all(torch.equal(merged[k], eng[k]) for k in merged)
        # the adapters moved the model; the trainer's frozen base did not
        hf_base = hf_tensor_views(base)
        assert any(not torch.equal(merged[k], hf_base[k]) for k in merged)
        frozen = dict(base.named_parameters())
        for name, p in trainer.policy.named_parameters():
            if name.endswith(".parametrizations.weight.original"):
                plain = name.replace(".parametrizations.weight.original", ".weight")
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # plain at one fp32 rank
                assert torch.equal(full, frozen[plain])
    finally:
        await engine.close()
        trainer.close()


async def test_engine_applies_the_sync_payload_and_refuses_bad_ones() -> None:
    """The launched path: `export_sync_state()` goes through the engine's own stage/commit."""
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.optim.lr = 5e-2
    cfg.lora.rank = 2
    cfg.lora.alpha = 6.0  # scale 3.0
    cfg.lora.targets = ["qkv_proj", "down_proj"]
    trainer = FSDPTrainer(cfg, SPEC, 0, 1, seed=4)
    engine = TorchEngine(build_model(SPEC, seed=4), EngineConfig(max_batch_size=8))
    try:
        ps = prompts(SPEC.vocab_size, 2, seed=0)
        trainer.train_step(to_batch(ps, await rollout(engine, ps, 4, run_seed=0, step=0), 4))
        payload = dict(trainer.export_sync_state())
        assert SCALE_NAME in payload and float(payload[SCALE_NAME]) == 3.0
        assert len(payload) == 2 * 2 * SPEC.num_layers + 1
        await engine.stage(1, payload.items())
        await engine.commit(1)
        merged = dict(trainer.export_hf_state())
        eng = engine.state_dict_hf()
        assert all(torch.equal(merged[k], eng[k]) for k in merged)
        sums = engine.checksums()
        assert all(sums[k] == tensor_checksum(v) for k, v in payload.items())
        # a version is full weights or adapters, never a mix; adapters need their scale
        with pytest.raises(EngineError, match="not both"):
            await engine.stage(2, [*payload.items(), *list(merged.items())[:1]])
        adapters = {k: v for k, v in payload.items() if k != SCALE_NAME}
        await engine.stage(2, adapters.items())
        with pytest.raises(EngineError, match="lora.scale"):
            await engine.commit(2)
        await engine.abort_version(2)
        broken = dict(payload)
        broken.pop(next(k for k in payload if k.endswith(".lora_B")))
        await engine.stage(3, broken.items())
        with pytest.raises(EngineError, match="bad adapter pair"):
            await engine.commit(3)
        await engine.abort_version(3)
        assert engine.version == 1 and engine.checksums() == sums  # nothing half-applied
    finally:
        await engine.close()
        trainer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_lora_true_on_policy_is_bitwise_exact(dtype: torch.dtype) -> None:
    """Adapter-only syncs + batch-invariant engine and trainer: logprobs equal bit for bit."""
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.param_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"  # type: ignore[assignment]
    cfg.micro_batch_tokens = 64
    cfg.optim.lr = 5e-2
    cfg.true_on_policy = True
    cfg.correction.old_logprobs = "recompute"
    cfg.lora.rank = 4
    cfg.lora.alpha = 8.0
    trainer = FSDPTrainer(cfg, SPEC, 0, 1, seed=5)
    engine = TorchEngine(
        build_model(SPEC, dtype=dtype, seed=5), EngineConfig(max_batch_size=5), batch_invariant=True
    )
    try:
        for step in range(3):  # steps 2 and 3 sample from base + synced, trained adapters
            ps = prompts(SPEC.vocab_size, 4, seed=step)
            res = await rollout(engine, ps, 2, run_seed=1, step=step, max_new=8)
            m = trainer.train_step(to_batch(ps, res, 2))
            assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
            await engine.stage(step + 1, list(trainer.export_sync_state()))
            await engine.commit(step + 1)
        assert engine.weights.adapters.active
    finally:
        await engine.close()
        trainer.close()
