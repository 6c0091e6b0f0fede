"""Forward options the trainer relies on: per-block forward, hidden state, selected logits, HF naming."""

from __future__ import annotations

import pytest
import torch

from miles.models.config import ModelSpec
from miles.models.decoder import DecoderLayer
from miles.models.errors import ModelInputError
from miles.models.hf_io import hf_param_slices, hf_param_views, hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def model_of(arch: str, **kw: object) -> torch.nn.Module:
    cfg = tiny_config(arch, vocab_size=40, initializer_range=0.2, **kw)
    return build_model(ModelSpec.from_hf(cfg), seed=3)


def test_forward_runs_each_decoder_block_as_a_module() -> None:
    model = model_of("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    calls: list[int] = []
    for i, layer in enumerate(model.model.layers):
        assert type(layer).forward is DecoderLayer.forward
        layer.register_forward_pre_hook(lambda _m, _a, i=i: calls.append(i))
    model(torch.zeros(1, 3, dtype=torch.long))
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hidden_and_selected_logits_agree_with_full_logits(arch: str) -> None:
    model = model_of(arch, tie_word_embeddings=arch == "qwen3")
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(0))
    full = model(ids, cu_seqlens=cu, return_hidden=True)
    assert full.hidden is not None and full.hidden.shape == (1, 9, model.spec.hidden_size)
    torch.testing.assert_close(model.logits_from_hidden(full.hidden), full.logits, rtol=1e-5, atol=1e-5)
    index = torch.tensor([1, 2, 5, 8])
    sel = model(ids, cu_seqlens=cu, logits_index=index)
    assert sel.logits.shape == (4, 40) and sel.hidden is None
    torch.testing.assert_close(sel.logits, full.logits[0, index], rtol=1e-5, atol=1e-5)
    only_hidden = model(ids, cu_seqlens=cu, return_hidden=True, compute_logits=False)
    assert only_hidden.logits is None
    torch.testing.assert_close(only_hidden.hidden, full.hidden, rtol=0, atol=0)
    rows = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    at = model(rows, logits_at=torch.tensor([4, 2]))
    torch.testing.assert_close(at.logits[:, 0], model(rows).logits[[0, 1], [4, 2]], rtol=1e-5, atol=1e-5)


def test_bad_logits_selection_is_rejected() -> None:
    model = model_of("llama")
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ModelInputError, match="logits_at must have shape"):
        model(ids, logits_at=torch.tensor([1]))
    with pytest.raises(ModelInputError, match="either logits_at or logits_index"):
        model(ids, logits_at=torch.tensor([1, 1]), logits_index=torch.tensor([0]))
    with pytest.raises(ModelInputError, match="logits_index must be 1-D"):
        model(ids, logits_index=torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_per_parameter_hf_naming_covers_the_whole_model(arch: str) -> None:
    model = model_of(arch)
    views = hf_tensor_views(model)
    seen: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        full = p.detach().clone()  # a stand-in for an FSDP full_tensor(): not the parameter itself
        for hf_name, view in hf_param_views(model.spec, name, full):
            assert hf_name not in seen
            seen[hf_name] = view
        assert len(hf_param_slices(model.spec, name, p.shape)) == len(hf_param_views(model.spec, name, full))
    assert seen.keys() == views.keys()
    for k, v in views.items():
        assert torch.equal(seen[k], v), k
    if arch == "qwen3_moe":
        e = model.spec.num_experts - 1
        assert f"model.layers.0.mlp.experts.{e}.up_proj.weight" in seen


def test_attention_accepts_non_contiguous_sdpa_output() -> None:
    """CUDA attention kernels return [B, T, H, d]-major outputs; the masked path must not
    assume the [B, H, T, d] layout is contiguous (a `.view` there failed on the H200)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class TransposedSDPA(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is F.scaled_dot_product_attention:
                out = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, T-major memory
                assert not out.is_contiguous()
            return out

    from miles.models.masks import padded_causal_mask

    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64)), seed=0)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = padded_causal_mask(torch.ones(2, 5))
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with TransposedSDPA():
            got = model(ids, attention_mask=mask).logits
    assert torch.equal(ref, got)
