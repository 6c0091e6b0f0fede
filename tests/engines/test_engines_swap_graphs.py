"""A weight commit swaps parameter storages (no copy), on the GPU too: the engine's decode
graphs are kept per weight storage, so after swapping to new weights and back, generation
equals a fresh engine on each weight set (a graph still pointing at the old storage would
produce the old weights' tokens)."""

from __future__ import annotations

import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.hf_io import hf_param_views, hf_tensor_views

from .conftest import tiny_model

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need a CUDA GPU")]


def _engine(model) -> TorchEngine:
    return TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=128, kv_budget_tokens=0, device="cuda",
                                           cuda_graphs=True))


async def _greedy(eng: TorchEngine) -> list[list[int]]:
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=0.0, max_new_tokens=24))
            for p in ([1, 2, 3], [4] * 9, [5, 6, 7, 8])]
    return [(await eng.generate(r)).output_ids for r in reqs]


async def test_swapping_commits_keep_graphs_valid() -> None:
    a = tiny_model("qwen3", seed=1).cuda()
    b = tiny_model("qwen3", seed=2).cuda()
    want_a, want_b = await _greedy(_engine(tiny_model("qwen3", seed=1).cuda())), await _greedy(_engine(b))
    assert want_a != want_b  # the two weight sets are told apart by their tokens
    eng = _engine(a)
    assert eng.weights.stager.bind_model(eng.model, lambda n, t: hf_param_views(eng.model.spec, n, t))
    assert await _greedy(eng) == want_a  # graphs captured on weight set A
    for version, (src, want) in enumerate([(b, want_b), (tiny_model("qwen3", seed=1).cuda(), want_a),
                                           (b, want_b)], start=1):
        await eng.stage(version, list(hf_tensor_views(src).items()))
        await eng.commit(version)
        assert await _greedy(eng) == want, f"after commit {version}"
    assert eng.stepper.graphs is not None and not eng.stepper.graphs.failed
    await eng.close()
