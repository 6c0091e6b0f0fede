"""core/ports.py: a group's port is picked below the kernel's ephemeral range, free at the pick."""

from __future__ import annotations

import socket

import pytest

from miles.core.ports import FLOOR, ephemeral_low, group_port

pytestmark = pytest.mark.timeout(30)


def test_a_group_port_is_below_the_ephemeral_range_and_free() -> None:
    low = ephemeral_low()
    ports = {group_port() for _ in range(8)}
    for port in ports:
        assert min(FLOOR, low // 2) <= port < low, (port, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: rank 0 can bind it


def test_a_port_held_by_another_socket_is_never_picked() -> None:
    held = []
    try:
        for _ in range(16):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", group_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 16 and group_port() not in taken
    finally:
        for s in held:
            s.close()
