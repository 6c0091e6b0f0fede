"""The local launcher splits the machine's cores between the compute roles."""

from __future__ import annotations

import os

import pytest

from miles.launch.local import role_threads

pytestmark = pytest.mark.timeout(30)
ROLES = [("engine", 0), ("rollout", 0), ("trainer", 0)]


def test_compute_roles_share_the_cores_rollout_gets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    each = str(max(1, cores // 2))
    assert role_threads("engine", ROLES) == {"OMP_NUM_THREADS": each, "MKL_NUM_THREADS": each}
    assert role_threads("trainer", ROLES)["OMP_NUM_THREADS"] == each
    assert role_threads("rollout", ROLES)["OMP_NUM_THREADS"] == "1"
    many = [("engine", i) for i in range(4 * cores)] + ROLES[1:]
    assert role_threads("engine", many)["OMP_NUM_THREADS"] == "1"  # never below one


def test_a_users_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert role_threads("engine", ROLES) == {}
