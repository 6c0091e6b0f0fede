"""`train/staleness` counts only the tokens the policy sampled, not tokens spliced in between turns."""

from __future__ import annotations

import numpy as np

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch


def test_spliced_tokens_are_not_stale() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    batch = engine_batch(build_model(spec, seed=2), groups=2, group_size=2, seed=0)
    spliced = 0
    for s in batch.samples:
        # A multi-turn sample: the middle third of the response is tool output spliced in
        # (version -1, masked out of the loss); the rest was sampled by the current weights.
        n = len(s.response_ids)
        lo, hi = n // 3, 2 * n // 3
        s.versions = np.array([-1 if lo <= i < hi else 0 for i in range(n)], np.int64)
        s.loss_mask = np.array([0 if lo <= i < hi else 1 for i in range(n)], s.loss_mask.dtype)
        spliced += hi - lo
    assert spliced > 0
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40
    t = FSDPTrainer(cfg, spec, 0, 1, seed=2)
    try:
        assert t.weight_version == 0
        out = t.train_step(batch)
    finally:
        t.close()
    assert out["train/staleness"] == 0.0
