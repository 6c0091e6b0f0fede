"""The decode graphs' memory pool and capture stream across a swap of graphs (issue 49).

The caching allocator keeps a graph pool's entry while any block of it is alive, and a capture
into an entry whose graphs are all destroyed fails `use_count > 0` (an INTERNAL ASSERT): the
H200's background-compile swap, where a view of an old graph's logits outlived the graphs. And
torch.cuda.graph enters its capture stream before `capture_begin`, so a capture that raises there
would leave the thread on that stream. GPU only: both are the CUDA caching allocator's and CUDA
graphs' behaviour."""

from __future__ import annotations

import pytest
import torch

from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.kv_cache import RowPool

from .conftest import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs and their memory pools)"),
]


def _graphs() -> DecodeGraphs:
    model = tiny_model("qwen3", num_hidden_layers=2, hidden_size=48).cuda()  # a shape no other test compiled
    pool = RowPool(model.spec, 4, 300, torch.float32, torch.device("cuda"))
    return DecodeGraphs(model, pool, capture=True, compiled=False)


def _step(g: DecodeGraphs) -> torch.Tensor:
    ids = torch.tensor([3, 4], device="cuda")
    pos = torch.tensor([0, 0], device="cuda")
    logits, _ = g.run_fed(ids, pos, 1, False)
    return logits


def test_swap_to_compiled_graphs_while_an_old_graphs_logits_are_held() -> None:
    g = _graphs()
    held = _step(g)  # a view of the uncompiled graph's static logits: a live block of its pool
    want = held.clone()
    g.use_compiled()  # drops every uncompiled graph and captures the compiled one
    assert g.compiled and not g.compile_failed
    got = _step(g)
    torch.cuda.synchronize()
    assert torch.allclose(got, want, atol=1e-4)  # the same step, from the compiled graph
    assert torch.isfinite(held).all()  # the old view is still readable memory


def test_a_capture_that_fails_to_begin_leaves_the_thread_on_its_stream() -> None:
    g = _graphs()
    # A pool whose only graph is gone while a block of it lives: capture_begin asserts into it.
    dead = torch.cuda.graph_pool_handle()
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=dead):
        out = x + 1
    del graph
    g._mempool = dead
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="use_count"):
        g._capture(2, 256, False)
    assert torch.cuda.current_stream() == before
    del out
