"""examples/gsm8k_qwen.toml: the recipe loads as written, and a launch without its checkpoint is
refused up front, naming model.path and the command that makes the checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.config import load_config
from miles.core.schema import MilesConfig
from miles.packaged.registry import MODELS
from miles.rollout.rewards.rules import build_rewards
from miles.rollout.types import Sample

pytestmark = pytest.mark.timeout(120)
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_qwen.toml"


def test_recipe_settings() -> None:
    cfg = load_config(MilesConfig, str(RECIPE), [])
    assert cfg.model.path == MODELS["qwen2.5-coder-0.5b"].default_out
    assert cfg.rollout.max_new_tokens == 512 and cfg.rollout.env_args["max_calc_steps"] == 0
    assert cfg.eval.at_start and cfg.eval.at_end and cfg.eval.full_at_ends and cfg.eval.every_steps == 25
    assert cfg.buffer.mode == "fully_async" and cfg.trainer.correction.types == ["tis"]
    assert cfg.trainer.optim.lr == 2e-6 and cfg.trainer.optim.grad_clip == 1.0
    # the reward: 1.2 for the right number in the last \boxed{} (the format the prompt asks for, which
    # the held-out strict score reads), 0.2 for a right answer without it, 0 otherwise
    assert cfg.rollout.env_args["answer_format"] == "boxed" and "\\boxed{}" in cfg.rollout.env_args["prompt_template"]
    reward = build_rewards(cfg.rollout.env_args["rewards"])
    label = {"label": "Natalia sold 48/2 = 24 clips in May.\n#### 72"}

    def score(text: str) -> float:
        return float(reward(label, Sample(prompt_ids=[0], metadata={"response": text})))

    assert score("48 + 24 = 72 clips, so she sold $\\boxed{72}$ clips.") == pytest.approx(1.2)
    assert score("48 + 24 = 72, so the answer is 72.") == pytest.approx(0.2)
    assert score("48 + 24 = 72 clips.\n#### 72") == pytest.approx(0.2)  # right, not in the asked-for place
    assert score("She sold 48 + 24 = 71, \\boxed{71}.") == 0.0
    assert cfg.trainer.recompute == "full" and cfg.trainer.micro_batch_tokens == 16384
    # room for the longest GSM8K prompt in Qwen's chat template (257 tokens, measured) and the answer
    assert cfg.engine.max_seq_len >= 257 + cfg.rollout.max_new_tokens


def test_launch_without_the_checkpoint_names_model_path(tmp_path: Path) -> None:
    absent, run = tmp_path / "qwen-not-fetched", tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "miles.launch.cli", "train", str(RECIPE), "--set",
                          f"model.path={absent}", "--set", f"run.dir={run}"],
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"model.path '{absent}' has no config.json" in res.stderr
    assert "miles fetch-model" in res.stderr
    assert not run.exists()  # refused before anything was written
