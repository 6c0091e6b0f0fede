"""Diffusion tests run torch on one thread: CI machines are small and shared, and two
threads contending for a busy core cost far more than they bring at these sizes. Deterministic
mode is process-wide (torch.use_deterministic_algorithms), so it is restored after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
