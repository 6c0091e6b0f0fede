"""Diffusion tests run torch on one thread: CI machines are small and shared, and two
threads contending for a busy core cost far more than they bring at these sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
