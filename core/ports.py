"""A free loopback port for a process group's rendezvous, picked where nothing else will take it.

A port found by binding to port 0 comes from the kernel's ephemeral range, the same range every
outgoing connection's source port comes from; between the pick and rank 0's bind, any process can
take it (CI saw EADDRINUSE at a trainer's init). Ports below that range are handed out only to
who asks for them by number, so a free one picked there stays free unless another picker takes it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FLOOR = 20000  # below it sit well-known services' registered ports
TRIES = 64


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    return 32768


def group_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the ephemeral range; the kernel's choice if none is."""
    low = ephemeral_low()
    floor = min(FLOOR, low // 2)
    # SystemRandom: pickers seeded alike (tests, a sweep) must not try the same ports in order
    for port in random.SystemRandom().sample(range(floor, low), k=min(TRIES, low - floor)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
