"""Message-size sweeps for `miles perftest`: parse `8B:1GiB:x4`-style specs, format sizes.

A spec is a comma-separated list of items; each item is one size (`64KiB`) or a
range `START:STOP:STEP` where STEP is `xN` (geometric, N >= 2) or `+SIZE` (arithmetic).
Sizes take the units B, KB/MB/GB (powers of 1000) and KiB/MiB/GiB (powers of 1024);
a bare number means bytes. Every mistake raises `ConfigError` naming the bad item.
"""

from __future__ import annotations

import re

from miles.core.errors import ConfigError

UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_SIZES = 256


def parse_size(text: str, where: str = "size") -> int:
    """`"64KiB"` -> 65536; raises ConfigError for anything that is not a positive byte count."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{where} {text!r} is not a size (examples: 8B, 64KiB, 4MiB, 1GiB, 1000)")
    unit = m.group(2).lower()
    if unit not in UNITS:
        raise ConfigError(f"{where} {text!r}: unknown unit {m.group(2)!r}; valid: B, KB, MB, GB, KiB, MiB, GiB")
    value = float(m.group(1)) * UNITS[unit]
    if value != int(value):
        raise ConfigError(f"{where} {text!r} is not a whole number of bytes")
    if value < 1:
        raise ConfigError(f"{where} {text!r} must be at least 1 byte")
    return int(value)


def parse_sizes(spec: str, limit: int) -> list[int]:
    """Sorted, de-duplicated sizes of `spec`; each at most `limit` bytes."""
    if not spec.strip():
        raise ConfigError("--sizes is empty (example: 8B:1GiB:x4)")
    out: set[int] = set()
    for item in spec.split(","):
        out.update(_item(item.strip(), spec))
    sizes = sorted(out)
    if sizes[-1] > limit:
        raise ConfigError(f"--sizes {spec!r}: {fmt_size(sizes[-1])} exceeds the limit of {fmt_size(limit)} "
                          "for this transport/machine")
    return sizes


def _item(item: str, spec: str) -> list[int]:
    parts = item.split(":")
    if len(parts) == 1:
        return [parse_size(item, "--sizes item")]
    if len(parts) != 3:
        raise ConfigError(f"--sizes item {item!r} in {spec!r}: a range is START:STOP:STEP, e.g. 8B:1GiB:x4")
    start, stop = parse_size(parts[0], "range start"), parse_size(parts[1], "range stop")
    if stop < start:
        raise ConfigError(f"--sizes range {item!r}: stop {parts[1]} is below start {parts[0]}")
    step = parts[2].strip()
    vals: list[int] = []
    if step.lower().startswith("x"):
        try:
            factor = int(step[1:])
        except ValueError as exc:
            raise ConfigError(f"--sizes range {item!r}: step {step!r} must be xN with an integer N >= 2") from exc
        if factor < 2:
            raise ConfigError(f"--sizes range {item!r}: step {step!r} must multiply by at least 2")
        v = start
        while v <= stop:
            vals.append(v)
            v *= factor
    elif step.startswith("+"):
        inc = parse_size(step[1:], f"range step of {item!r}")
        vals = list(range(start, stop + 1, inc))
    else:
        raise ConfigError(f"--sizes range {item!r}: step {step!r} must be xN (multiply) or +SIZE (add)")
    if len(vals) > MAX_SIZES:
        raise ConfigError(f"--sizes range {item!r} yields {len(vals)} sizes; at most {MAX_SIZES}")
    return vals


def fmt_size(n: int) -> str:
    """65536 -> '64KiB'; exact binary units when they divide, else two decimals of the largest."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.2f}{unit}"
    return f"{n}B"


def iterations(size: int, iters: int, warmup: int, max_bytes: int, block: int) -> tuple[int, int]:
    """(measured, warm-up) message counts for one size, whole blocks of `block` messages.

    Large sizes are capped so one size moves about `max_bytes`, but always at least
    three blocks are measured (a p99 of fewer samples says nothing).
    """
    cap = max(3 * block, max_bytes // size)
    n = min(iters, cap)
    n = max(block, (n + block - 1) // block * block)
    w = min(warmup, max(block, n // 4)) if warmup > 0 else 0
    w = (w + block - 1) // block * block
    return n, w
