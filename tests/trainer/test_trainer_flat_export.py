"""The trainer's flat export buffer (weightsync/flat_export.py): filled in place, rebuilt on change."""

from __future__ import annotations

import pytest
import torch

from miles.weightsync.flat_export import FlatExportBuffer

pytestmark = pytest.mark.timeout(30)


def _state(scale: float, n: int = 3) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((i + 1, 2), scale * (i + 1))) for i in range(n)]


def test_refills_the_same_buffer_in_place() -> None:
    buf = FlatExportBuffer()
    first = buf.fill(_state(1.0))
    ptr = first.buffer.data_ptr()
    second = buf.fill(_state(2.0))
    assert second is first and second.buffer.data_ptr() == ptr  # the plan and the memory persist
    got = dict(second)
    assert all(torch.equal(got[n], t) for n, t in _state(2.0))


def test_a_changed_tensor_list_builds_a_new_buffer_with_every_value() -> None:
    buf = FlatExportBuffer()
    buf.fill(_state(1.0))
    grown = buf.fill(_state(3.0, n=4))  # one more tensor
    assert grown.plan.names == ("w0", "w1", "w2", "w3")
    assert all(torch.equal(dict(grown)[n], t) for n, t in _state(3.0, n=4))
    shrunk = buf.fill(_state(4.0, n=2))
    assert shrunk.plan.names == ("w0", "w1") and all(torch.equal(dict(shrunk)[n], t) for n, t in _state(4.0, n=2))
    reshaped = buf.fill([("w0", torch.ones(3)), ("w1", torch.zeros(4, 2))])
    assert reshaped.plan.shapes == ((3,), (4, 2))


def test_dtype_conversion_and_mixed_dtypes() -> None:
    buf = FlatExportBuffer()
    fw = buf.fill(_state(1.5), dtype=torch.bfloat16)
    assert fw.plan.dtypes == ("bfloat16",) * 3
    assert torch.equal(dict(fw)["w2"], torch.full((3, 2), 4.5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="several dtypes"):
        FlatExportBuffer().fill([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_one_rank_fast_refill_equals_the_gathered_export(arch: str) -> None:
    """fill_local (one multi-tensor copy through cached view pairs) gives the bytes of the
    per-tensor export, in the wire dtype, after in-place updates and after a parameter moves."""
    from miles.models.config import ModelSpec
    from miles.models.hf_io import hf_tensor_views
    from miles.models.presets import tiny_config
    from miles.models.registry import build_model

    model = build_model(ModelSpec.from_hf(tiny_config(arch, vocab_size=64)), seed=1)
    params = lambda: [(n, p.detach()) for n, p in model.named_parameters()]  # noqa: E731
    fast, ref = FlatExportBuffer(), FlatExportBuffer()
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.1)
        if step == 2:  # a parameter re-allocated (as an offload and reload does): pairs rebuilt
            first = next(model.parameters())
            first.data = first.data.clone()
        got = fast.fill_local(model.spec, params(), torch.bfloat16)
        want = ref.fill(hf_tensor_views(model).items(), torch.bfloat16)
        assert got.plan.names == want.plan.names and torch.equal(got.buffer, want.buffer)
    assert fast.fill_local(model.spec, params(), torch.bfloat16).buffer.data_ptr() == got.buffer.data_ptr()
