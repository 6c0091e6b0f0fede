"""Each sample's logprobs are taken under the temperature it was sampled at (issue 36)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.core.config import load_config
from miles.core.errors import ConfigError, TrainerError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.packing import pack
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(120)


def _cfg() -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 64
    cfg.correction.types = ["tis"]
    return cfg


def _mixed(model: object, temps: tuple[float, ...]) -> TrainBatch:
    """Groups sampled at different temperatures, as per-prompt overrides give them, interleaved."""
    parts = [engine_batch(model, groups=2, group_size=2, temperature=t, seed=10 + i)  # type: ignore[arg-type]
             for i, t in enumerate(temps)]
    samples: list[TrainSample] = []
    for i, part in enumerate(parts):
        for s in part.samples:
            s.group_index += 2 * i
    for j in range(len(parts[0].samples)):
        samples += [p.samples[j] for p in parts]
    return TrainBatch(samples)


@pytest.mark.parametrize("backend_temp", [0.7, 1.3])
def test_each_sample_trains_under_its_own_temperature(backend_temp: float) -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    model = build_model(spec, seed=3)
    batch = _mixed(model, (backend_temp, 1.0, 0.0))  # 0 = greedy, whose logprobs are at 1
    t = FSDPTrainer(_cfg(), spec, 0, 1, seed=3)
    t.policy.load_state_dict(model.state_dict())
    out = t.train_step(batch)
    t.close()
    assert out["train/train_rollout_logprob_abs_diff_max"] < 1e-5
    # The same samples labelled with one temperature (what a single trainer.temperature did) do not match.
    for s in batch.samples:
        s.temperature = 1.0
    t = FSDPTrainer(_cfg(), spec, 0, 1, seed=3)
    t.policy.load_state_dict(model.state_dict())
    wrong = t.train_step(batch)
    t.close()
    assert wrong["train/train_rollout_logprob_abs_diff"] > 1e-2


def test_a_micro_batch_never_mixes_temperatures() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    batch = _mixed(build_model(spec, seed=3), (0.7, 1.0))
    with pytest.raises(TrainerError, match="temperatures"):
        pack(batch.samples, [0, 1])
    mb = pack(batch.samples, [0, 2])
    assert mb.temperature == 0.7 and mb.to("cpu").temperature == 0.7


def test_sample_temperature_is_checked() -> None:
    with pytest.raises(TrainerError, match="temperature"):
        TrainSample(prompt_ids=[1], response_ids=[2], reward=0.0, temperature=-1.0)
    with pytest.raises(TrainerError, match="temperature"):
        TrainSample(prompt_ids=[1], response_ids=[2], reward=0.0, temperature=float("nan"))
    assert TrainSample(prompt_ids=[1], response_ids=[2], reward=0.0, temperature=0).logprob_temperature == 1.0


def test_trainer_temperature_is_gone_with_a_pointer(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[trainer]\ntemperature = 0.7\n")
    with pytest.raises(ConfigError, match="trainer.temperature' was removed: each sample carries"):
        load_config(MilesConfig, str(p))


def test_truncated_sampling_is_refused_at_launch(tmp_path) -> None:
    for line in ("top_p = 0.9", "top_k = 20"):
        p = tmp_path / "c.toml"
        p.write_text(f"[rollout]\n{line}\n")
        with pytest.raises(ConfigError, match="truncated sampling"):
            load_config(MilesConfig, str(p))
    p.write_text("[rollout]\ntop_p = 1.0\ntop_k = 0\ntemperature = 0.7\n")
    assert load_config(MilesConfig, str(p)).rollout.temperature == 0.7
    assert np.isclose(load_config(MilesConfig, str(p)).trainer.batch_timeout_s, 1200.0)
