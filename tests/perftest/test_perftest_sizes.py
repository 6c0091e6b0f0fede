"""Size specs of `--sizes`: units, ranges, steps, limits, and the per-size iteration plan."""

from __future__ import annotations

import pytest

from miles.core.errors import ConfigError
from miles.transport.perf.patterns import make_plans
from miles.transport.perf.sizes import fmt_size, iterations, parse_size, parse_sizes

GIB = 1 << 30


def test_units() -> None:
    assert parse_size("8B") == 8 and parse_size("8") == 8
    assert parse_size("64KiB") == 65536 and parse_size("64kb") == 64000
    assert parse_size("1.5MiB") == 3 << 19 and parse_size("1GiB") == GIB


def test_geometric_and_arithmetic_ranges_and_lists() -> None:
    assert parse_sizes("8B:1GiB:x4", 4 * GIB)[:3] == [8, 32, 128]
    assert parse_sizes("8B:1GiB:x4", 4 * GIB)[-1] == 512 << 20  # 8 * 4^13 <= 1 GiB < 8 * 4^14
    assert parse_sizes("1KiB:4KiB:+1KiB", GIB) == [1024, 2048, 3072, 4096]
    assert parse_sizes("64KiB,8B,8B:16B:x2", GIB) == [8, 16, 65536]


@pytest.mark.parametrize("spec", ["", "0B", "1.3B", "8Q", "8B:4B:x2", "8B:1GiB:x0", "8B:1GiB", "x", "8B:16B:+0"])
def test_bad_specs_raise_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_sizes(spec, GIB)


def test_limit() -> None:
    with pytest.raises(ConfigError, match="exceeds the limit of 1GiB"):
        parse_sizes("2GiB", GIB)


def test_fmt_size() -> None:
    assert [fmt_size(n) for n in (8, 65536, 4 << 20, 512 << 20, 1536)] == ["8B", "64KiB", "4MiB", "512MiB", "1.50KiB"]


def test_iterations_are_whole_blocks_and_capped_by_bytes() -> None:
    n, w = iterations(8, 1000, 100, GIB, 16)
    assert n == 1008 and w == 112 and n % 16 == 0 and w % 16 == 0
    n, w = iterations(512 << 20, 1000, 100, GIB, 16)
    assert n == 48  # at least three blocks even above the byte cap
    n, w = iterations(64 << 20, 1000, 10, GIB, 1)
    assert n == 16 and w == 4
    plans = make_plans("pingpong", [8, 1024], 10, 2, 16, GIB)
    assert [p.block for p in plans] == [1, 1] and plans[0].total == 12
