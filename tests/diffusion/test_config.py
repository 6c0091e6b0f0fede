"""The diffusion config: every option documented, the example loads, bad input is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.core.config import check_documented, load_config
from miles.core.errors import ConfigError
from miles.diffusion.config import DiffusionConfig
from miles.diffusion.recipe import DiffusionRecipe

pytestmark = pytest.mark.timeout(30)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "diffusion.toml"


def test_documented_and_example_loads() -> None:
    assert check_documented(DiffusionConfig) == []
    cfg = load_config(DiffusionConfig, EXAMPLE)
    assert cfg.buffer.mode == "fully_async" and cfg.reward.target == "circle" and cfg.trainer.correction.types == ["tis"]


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="trainer.lrr"):
        load_config(DiffusionConfig, None, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match="n_samples"):
        load_config(DiffusionConfig, None, ["n_samples=1"])
    with pytest.raises(ConfigError, match="one_step_off"):
        DiffusionRecipe(load_config(DiffusionConfig, None, ["buffer.mode=one_step_off"]))
