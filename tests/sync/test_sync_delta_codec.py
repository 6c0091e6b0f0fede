"""delta_codec: XOR/compression round trips, the auto sample gate, decoding into a given buffer."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import SyncError
from miles.transport.bulk.delta_codec import as_bytes, decode, digest, encode


def _pair(n: int = 1 << 17) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(n, generator=g) * 0.02
    return as_bytes(old), as_bytes(old + 1e-3)


@pytest.mark.parametrize("gate", [False, True])
def test_round_trip_into_a_given_buffer(gate: bool) -> None:
    old, new = _pair()
    enc, payload = encode(new, old, "zlib", sample_gate=gate)
    # dense float changes save ~25% under zlib: worth it only when asked for explicitly; left
    # uncompressed they go as the bytes themselves (no XOR pass on either side)
    assert enc == ("full+raw" if gate else "xor+zlib")
    if gate:
        assert bytes(payload) == bytes(new.numpy())
    out = torch.zeros_like(new)
    got = decode(enc, memoryview(payload), old, new.numel(), "t", out)
    assert got.data_ptr() == out.data_ptr() and digest(out) == digest(new)


def test_sparse_changes_still_compress_under_auto_and_unchanged_is_same() -> None:
    old, _ = _pair()
    new = old.clone()
    new[::4096] ^= 1
    enc, payload = encode(new, old, "zlib", sample_gate=True)
    assert enc == "xor+zlib" and len(payload) < new.numel() // 10
    assert torch.equal(decode(enc, memoryview(payload), old, new.numel(), "t"), new)
    assert encode(old.clone(), old, "zlib", sample_gate=True) == ("same", b"")


def test_no_compression_sends_the_bytes_not_their_xor() -> None:
    old, new = _pair(1 << 12)
    enc, payload = encode(new, old, "raw")
    assert enc == "full+raw" and bytes(payload) == bytes(new.numpy())
    out = torch.zeros_like(new)
    assert torch.equal(decode(enc, memoryview(payload), old, new.numel(), "t", out), new)


def test_flipped_byte_or_wrong_target_is_an_error() -> None:
    old, new = _pair(1 << 12)
    enc, payload = encode(new, None, "raw")
    bad = bytearray(payload)
    bad[7] ^= 0xFF
    assert digest(decode(enc, memoryview(bytes(bad)), None, new.numel(), "t")) != digest(new)
    with pytest.raises(SyncError, match="decode target"):
        decode(enc, memoryview(payload), None, new.numel(), "t", torch.empty(3, dtype=torch.uint8))
