"""Per-parameter FP32: the switch keeps the named parameters FP32 (engine and trainer units),
refuses a pattern that names nothing, and brings the trainer's log-probabilities closer to
the FP32 engine's than all-BF16 does."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import ConfigError
from miles.core.schema.trainer import CorrectionConfig
from miles.diffusion.config import DiffusionTrainerConfig, PrecisionConfig
from miles.diffusion.precision import apply_precision, fp32_fraction
from miles.diffusion.trainer import DiffusionTrainer

from .helpers import SCHED, SPEC, batch_from, tiny_net

pytestmark = pytest.mark.timeout(90)
FP32 = ["time_embed.*", "cond_embed.*", "conv_in.*", "conv_out.*"]


def test_patterns_pick_the_fp32_parameters() -> None:
    net = apply_precision(tiny_net(), torch.bfloat16, FP32)
    for name, p in net.named_parameters():
        want = torch.float32 if name.split(".")[0] in ("time_embed", "cond_embed", "conv_in", "conv_out") else torch.bfloat16
        assert p.dtype == want, name
    assert 0 < fp32_fraction(net) < 0.5
    x = torch.randn(2, 3, 16, 16)
    assert net(x, torch.rand(2), torch.tensor([0, 3])).dtype == torch.float32  # a mixed model runs as is
    with pytest.raises(ConfigError, match="time_embedding"):
        apply_precision(tiny_net(), torch.bfloat16, ["time_embedding.*"])


def _trainer(dtype: str, fp32: list[str], state: dict[str, torch.Tensor]) -> DiffusionTrainer:
    cfg = DiffusionTrainerConfig(correction=CorrectionConfig(types=["tis"]))
    return DiffusionTrainer(cfg, PrecisionConfig(trainer_dtype=dtype, fp32_params=fp32), SCHED, SPEC, state)


def test_trainer_mismatch_fp32_tiny_and_per_param_fp32_below_all_bf16() -> None:
    net = tiny_net()
    b = batch_from(net)
    state = net.state_dict()
    diffs = {}
    for label, dtype, fp32 in (("fp32", "float32", []), ("bf16", "bfloat16", []), ("mixed", "bfloat16", FP32)):
        tr = _trainer(dtype, fp32, state)
        diffs[label] = float((tr.logprobs(b) - b.rollout_logp).abs().mean())
    assert diffs["fp32"] <= 1e-5, diffs
    assert diffs["mixed"] < diffs["bf16"], diffs
