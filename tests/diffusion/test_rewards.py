"""Rewards by import path: the rule rewards score what they say, the classifier reward loads
from the run's weights, and a bad import path is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.core.errors import ConfigError
from miles.diffusion.classifier import save_classifier, train_classifier
from miles.diffusion.config import RewardConfig
from miles.diffusion.data import draw_shapes
from miles.diffusion.rewards import centred, load_reward, red_left

pytestmark = pytest.mark.timeout(60)


def _red_square(x0: int) -> torch.Tensor:
    img = -torch.ones(1, 3, 16, 16)
    img[0, 0, 6:10, x0:x0 + 4] = 1.0
    return img


def test_rule_rewards() -> None:
    left, right = _red_square(1), _red_square(11)
    fn = load_reward(RewardConfig(fn="miles.diffusion.rewards:red_left"))
    assert fn is red_left
    assert float(red_left(left, torch.zeros(1))) > 0 > float(red_left(right, torch.zeros(1)))
    mid = _red_square(6)
    assert float(centred(mid, torch.zeros(1))) > float(centred(left, torch.zeros(1)))
    assert float(centred(-torch.ones(1, 3, 16, 16), torch.zeros(1))) == 0.0


def test_classifier_reward_from_saved_weights(tmp_path: Path) -> None:
    clf, _ = train_classifier(steps=3, batch=16)
    save_classifier(clf, tmp_path / "clf.safetensors")
    fn = load_reward(RewardConfig(classifier=str(tmp_path / "clf.safetensors"), target="square"))
    imgs = draw_shapes(torch.tensor([0, 1, 2]), generator=torch.Generator().manual_seed(0))
    r = fn(imgs, torch.zeros(3, dtype=torch.long))
    assert r.shape == (3,) and bool(((r >= 0) & (r <= 1)).all())
    with torch.no_grad():
        torch.testing.assert_close(r, clf(imgs).softmax(1)[:, 1])


def test_bad_reward_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reward.fn"):
        load_reward(RewardConfig(fn="miles.diffusion.rewards:no_such_reward"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_reward(RewardConfig(classifier=str(tmp_path / "missing.safetensors")))
