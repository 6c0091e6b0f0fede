"""Packed rows through per-sequence attention (models/varlen.py) equal the masked path."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_reduced_close, forward_sums

from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama"])
def test_varlen_packed_attention_equals_the_masked_path(arch: str) -> None:
    model = build_model(ModelSpec.from_hf(tiny_config(arch, vocab_size=64)), seed=3)
    lens = [5, 1, 9, 0, 7]  # an empty sequence and a one-token one included
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, 64, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("masked", "varlen"):
        model.zero_grad()
        model.packed_attention = mode
        assert model._varlen(ids.device, ids.shape[1]) == (mode == "varlen")
        logits = model(ids, cu_seqlens=cu).logits
        logits.float().logsumexp(-1).sum().backward()
        out[mode] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    k, depth = forward_sums(model.spec, sum(lens))  # other attention kernels: other summation orders
    assert_reduced_close(out["varlen"][0], out["masked"][0], k=k, depth=depth)
    assert out["varlen"][1].keys() == out["masked"][1].keys()
    for n, g in out["masked"][1].items():
        assert_reduced_close(out["varlen"][1][n], g, k=k, depth=2 * depth, what=n)


def test_each_packed_sequence_equals_its_own_forward() -> None:
    """The varlen row is exactly the sequences run one by one (no cross-sequence attention)."""
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64)), seed=4)
    model.packed_attention = "varlen"
    seqs = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 3, 8)]
    cu = torch.tensor([0, 6, 9, 17], dtype=torch.int32)
    packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu).logits
    alone = torch.cat([model(s).logits for s in seqs], dim=1)
    assert_reduced_close(packed, alone, *forward_sums(model.spec, 17))


def test_auto_keeps_the_mask_on_cpu_and_for_other_attention_kinds() -> None:
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64)), seed=1)
    assert not model._varlen(torch.device("cpu")) and model._varlen(torch.device("cuda"), 16384)
    assert not model._varlen(torch.device("cuda"), 4096)  # small packs: one masked call is faster
    gpt_oss = build_model(ModelSpec.from_hf(tiny_config("gpt_oss", vocab_size=64)), seed=1)
    gpt_oss.packed_attention = "varlen"
    assert not gpt_oss._varlen(torch.device("cuda"))  # sinks and windows need their mask
