"""MoE routing: ids returned per token and layer, replay reproduces logits, gate keeps its gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numerics import assert_reduced_close

from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.logprobs import token_logprobs
from miles.models.moe import compact_expert_ids, expert_id_dtype
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def moe_model(**kw: object) -> torch.nn.Module:
    cfg = tiny_config("qwen3_moe", vocab_size=64, initializer_range=0.2, num_hidden_layers=3, **kw)
    return build_model(ModelSpec.from_hf(cfg), seed=1)


def test_routed_experts_shape_and_replay_reproduces_logits() -> None:
    model = moe_model(mlp_only_layers=[1])
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    out = model(ids, return_routed_experts=True)
    assert out.routed_experts.shape == (2, 7, 2, 2)  # layers 0 and 2 are MoE, k=2
    replay = model(ids, routed_experts=out.routed_experts, return_routed_experts=True)
    assert torch.equal(replay.routed_experts, out.routed_experts)
    assert torch.allclose(replay.logits, out.logits, atol=0, rtol=0)


def test_replay_with_other_ids_changes_logits_and_gate_gets_gradient() -> None:
    model = moe_model()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    out = model(ids, return_routed_experts=True)
    other = (out.routed_experts + 1) % model.spec.num_experts
    replay = model(ids, routed_experts=other)
    assert not torch.allclose(replay.logits, out.logits)
    loss = token_logprobs(replay.logits[0, :-1], ids[0, 1:]).sum()
    loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_bad_routed_experts_are_rejected_with_clear_error() -> None:
    model = moe_model()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ModelInputError, match=r"routed_experts shape"):
        model(ids, routed_experts=torch.zeros(1, 4, 2, 2, dtype=torch.long))
    with pytest.raises(ModelInputError, match=r"expert id 8 >= num_experts=8"):
        model(ids, routed_experts=torch.full((1, 4, 3, 2), 8, dtype=torch.long))


def test_expert_id_dtype_is_compact() -> None:
    assert expert_id_dtype(256) == np.uint8
    assert expert_id_dtype(257) == np.uint16
    arr = compact_expert_ids(torch.tensor([[3, 255]]), 256)
    assert arr.dtype == np.uint8 and arr.tolist() == [[3, 255]]


def test_token_logprobs_is_temperature_scaled_full_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    got = token_logprobs(logits, torch.tensor([2]), temperature=0.5)
    want = torch.log_softmax(logits / 0.5, -1)[0, 2]
    assert torch.allclose(got, want.unsqueeze(0))
    greedy = token_logprobs(logits, torch.tensor([2]), temperature=0.0)
    assert torch.allclose(greedy, torch.log_softmax(logits, -1)[:, 2])


def test_dense_and_grouped_expert_paths_agree_with_gradients() -> None:
    model = moe_model()
    block = model.model.layers[0].mlp
    x = torch.randn(5, model.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 3], [3, 7], [1, 0], [7, 6], [2, 2]])  # a repeated id counts twice
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    outs, grads = [], []
    for path in (block.experts._dense, block.experts._grouped):
        block.zero_grad()
        y = path(x, ids, w)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append(block.experts.gate_up_proj.grad.clone())
    # one GEMM per expert against one grouped GEMM: other blockings of the hidden / expert-MLP
    # sums (and of the sum over tokens in the weight gradient)
    sp = model.spec
    k = max(sp.hidden_size, sp.moe_intermediate_size, x.shape[0])
    assert_reduced_close(outs[0], outs[1], k=k, depth=2)
    assert_reduced_close(grads[0], grads[1], k=k, depth=4)


def test_moe_block_outputs_are_not_views() -> None:
    block = moe_model().model.layers[0].mlp
    out, ids = block(torch.randn(2, 3, block.gate.in_features))
    assert out._base is None and ids._base is None
