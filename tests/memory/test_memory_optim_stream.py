"""Streamed AdamW (moments on disk per bucket) equals in-memory AdamW bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.optim_stream import StreamedAdamW
from miles.trainer.synthetic import engine_batch


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (5,), (64, 16), (3, 3, 3), (1,), (128,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_streamed_matches_adamw_over_steps(tmp_path: Path) -> None:
    ref, mine = _params(0), _params(0)
    kw = {"lr": 3e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.01}
    a = torch.optim.AdamW(ref, foreach=False, **kw)  # type: ignore[arg-type]
    # ~600 bytes per bucket: several buckets, one parameter larger than a bucket
    b = StreamedAdamW(mine, directory=tmp_path, bucket_bytes=600, device=torch.device("cpu"), **kw)  # type: ignore[arg-type]
    assert len(b.buckets) >= 4
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        for i, (p, q) in enumerate(zip(ref, mine, strict=True)):
            if step == 2 and i == 1:  # a parameter without a gradient is skipped by both
                p.grad = q.grad = None
                continue
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        for opt, lr in ((a, 3e-3 / (step + 1)), (b, 3e-3 / (step + 1))):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        for p, q in zip(ref, mine, strict=True):
            assert torch.equal(p, q)
    for p, q in zip(ref, mine, strict=True):
        m, v = b.moments(q)
        assert torch.equal(m, a.state[p]["exp_avg"]) and torch.equal(v, a.state[p]["exp_avg_sq"])
        assert torch.equal(b.steps[q], a.state[p]["step"])
    assert len(list(tmp_path.glob("moments_*.bin"))) == len(b.buckets)
    assert not b.state  # nothing of the moments stays in memory
    b.close()


def test_trainer_with_streamed_optimizer_is_bit_identical(tmp_path: Path) -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    batches = [
        engine_batch(build_model(spec, seed=3), groups=2, group_size=2, seed=s) for s in range(3)
    ]

    def run(optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        cfg = TrainerConfig()
        cfg.device = "cpu"
        cfg.micro_batch_tokens = 40
        cfg.optim.lr = 1e-3
        cfg.optim.weight_decay = 0.1
        cfg.mini_batches = 2
        cfg.memory.optimizer = optimizer  # type: ignore[assignment]
        cfg.memory.stream_dir = str(tmp_path)
        cfg.memory.stream_bucket_mb = 0.05
        t = FSDPTrainer(cfg, spec, 0, 1, seed=3)
        losses = [t.train_step(b)["train/loss"] for b in batches]
        if optimizer == "streamed":
            assert isinstance(t.opt, StreamedAdamW) and len(t.opt.buckets) > 2
        return losses, {k: v.clone() for k, v in t.export_hf_state()}

    la, wa = run("adamw")
    lb, wb = run("streamed")
    assert la == lb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_stream_config() -> None:
    with pytest.raises(ConfigError, match="trainer.memory.optimizer"):  # the loader takes only the Literal's values
        load_config(MilesConfig, None, ["trainer.memory.optimizer=disk"])
