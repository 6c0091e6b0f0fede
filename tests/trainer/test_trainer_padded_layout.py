"""trainer.packed_attention = 'padded': the micro-batch's sequences as padded rows give the same
step as the packed row (logprobs, R3 replay, routing overlap, loss, gradients) within fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_reduced_close, forward_sums

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch
from miles.trainer.forward import padded_layout
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.packing import pack
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=2))


def _trainer(mode: str) -> FSDPTrainer:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40  # several micro-batches of several sequences each
    cfg.optim.lr = 1e-3
    cfg.correction.types = ["tis"]
    cfg.packed_attention = mode  # type: ignore[assignment]
    return FSDPTrainer(cfg, SPEC, 0, 1, seed=5)


def _grads(t: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in t.policy.named_parameters() if p.grad is not None}


def test_padded_layout_puts_every_token_in_its_row() -> None:
    batch: TrainBatch = engine_batch(build_model(SPEC, seed=3), groups=2, group_size=3, seed=1)
    s = batch.samples
    mb = pack(s, list(range(len(s))), {}, replay=True)
    ids, pos, index = padded_layout(mb)
    longest = max(x.total_len for x in s)
    assert ids.shape == (len(s), longest) and pos.shape == ids.shape
    for row, x in enumerate(s):
        n = x.total_len
        assert ids[row, :n].tolist() == [*x.prompt_ids.tolist(), *x.response_ids.tolist()]
        assert (ids[row, n:] == 0).all()
    assert torch.equal(ids.reshape(-1)[index], mb.input_ids)


def test_padded_step_matches_packed_step() -> None:
    batch = engine_batch(build_model(SPEC, seed=3), groups=3, group_size=3, seed=7)
    padded, packed = _trainer("padded"), _trainer("varlen")
    for step in range(2):  # step 2 trains with moved weights
        mp, mk = padded.train_step(batch), packed.train_step(batch)
        for k in ("train/loss", "train/pg_loss", "train/ratio_mean", "train/entropy", "train/grad_norm",
                  "train/routing_overlap", "train/train_rollout_logprob_abs_diff", "train/tis_fraction"):
            assert mp[k] == pytest.approx(mk[k], rel=1e-5, abs=1e-6), (step, k)
        gp, gk = _grads(padded), _grads(packed)
        assert gp.keys() == gk.keys() and gp
        k, depth = forward_sums(SPEC, sum(x.total_len for x in batch.samples))  # other attention kernels
        for n in gp:
            assert_reduced_close(gp[n], gk[n], k=k, depth=2 * depth, what=n)
    padded.close()
    packed.close()


def test_padded_rows_reproduce_the_engine_logprobs() -> None:
    # the trainer starts from the engine's weights: its first-step logprobs are the engine's
    batch = engine_batch(build_model(SPEC, seed=3), groups=2, group_size=3, seed=2)
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40
    cfg.packed_attention = "padded"
    t = FSDPTrainer(cfg, SPEC, 0, 1, seed=3)
    m = t.train_step(batch)
    assert m["train/train_rollout_logprob_abs_diff_max"] < 1e-5
    assert m["train/routing_overlap"] == pytest.approx(1.0)
    t.close()
