"""The engine's CPU inference dispatch of the routed experts (models/moe_cpu.py): only the selected
experts against every expert densely, which path each token count takes, the trainer's path kept,
and the router's ids unchanged."""

from __future__ import annotations

import pytest
import torch

from miles.models.config import ModelSpec
from miles.models.moe import Experts
from miles.models.moe_cpu import grouped_mm_fits, grouped_mm_on_cpu, prefer_dense, selected_experts
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(60)

needs_cpu_grouped_mm = pytest.mark.skipif(not grouped_mm_on_cpu(torch.float32),
                                          reason="this torch has no CPU torch._grouped_mm (2.9 and later do)")

# fp32: each output element is a sum over k slots of a length-I dot product of activations made
# from length-H dot products; the paths differ only in summation order and GEMM blocking, so
# they agree to a few ulps of those sums: ~sqrt(H + I) * 2^-24 relative, ~1e-6 at H = 128. The
# tolerance gives 10x room, far below the outputs' own scale (~1) and what a wrong expert,
# weight or token would change (O(1) per element).
RTOL, ATOL = 1e-5, 1e-5


def _experts(e: int, h: int, i: int, seed: int) -> Experts:
    torch.manual_seed(seed)
    ex = Experts(e, h, i)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, h**-0.5)
        ex.down_proj.normal_(0, i**-0.5)
    return ex


def _routing(n: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (n, k), generator=g)  # random routing: repeats within a token allowed
    w = torch.softmax(torch.randn(n, k, generator=g), dim=-1)
    return torch.randn(n, 32, generator=g) * 2, ids, w


@needs_cpu_grouped_mm
@pytest.mark.parametrize(("n", "e", "k"), [(1, 4, 1), (8, 16, 4), (8, 16, 1), (37, 16, 4), (5, 64, 8), (300, 8, 2)])
def test_selected_experts_match_the_dense_path(n: int, e: int, k: int) -> None:
    ex = _experts(e, 32, 16, seed=n + e + k)
    x, ids, w = _routing(n, e, k, seed=n * k)
    with torch.inference_mode():
        got = selected_experts(x, ids, w, ex.gate_up_proj, ex.down_proj)
        torch.testing.assert_close(got, ex._dense(x, ids, w), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got, ex._grouped(x, ids, w), rtol=RTOL, atol=ATOL)


@needs_cpu_grouped_mm
def test_a_token_routed_to_one_expert_twice_gets_both_slots() -> None:
    ex = _experts(6, 32, 16, seed=3)
    x, ids, w = _routing(4, 6, 3, seed=4)
    ids[0] = torch.tensor([2, 2, 2])
    ids[1] = torch.tensor([5, 1, 5])
    with torch.inference_mode():
        got = selected_experts(x, ids, w, ex.gate_up_proj, ex.down_proj)
        one = ex._dense(x[:1], torch.tensor([[2]]), torch.ones(1, 1))  # expert 2 alone, weight 1
        torch.testing.assert_close(got[:1], one * w[0].sum(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got, ex._dense(x, ids, w), rtol=RTOL, atol=ATOL)


def test_the_dense_crossover_is_where_it_was_measured() -> None:
    # bench/engine.py's CPU MoE: 16 experts top-4, hidden 128, inter 64 (gate_up rows 128), fp32:
    # dense measured faster up to N = 16, the grouped GEMM from N = 24 (models/moe_cpu.py)
    assert all(prefer_dense(n, 4, 16, 128, 128, 4) for n in (1, 2, 8, 16))
    assert not any(prefer_dense(n, 4, 16, 128, 128, 4) for n in (24, 32, 256))
    # 64 experts top-8, hidden 512, inter 128: dense reads 8x the needed weights at N = 1 and lost
    assert not any(prefer_dense(n, 8, 64, 256, 512, 4) for n in (1, 8, 64))


@needs_cpu_grouped_mm
@pytest.mark.parametrize("n", [8, 24])
def test_forward_takes_the_picked_path_in_inference_and_the_old_one_in_training(n: int) -> None:
    ex = _experts(16, 128, 64, seed=5)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 128, generator=g)
    ids = torch.rand(n, 16, generator=g).argsort(dim=1)[:, :4]
    w = torch.softmax(torch.randn(n, 4, generator=g), dim=-1)
    with torch.inference_mode():
        got = ex(x, ids, w)
        picked = ex._dense(x, ids, w) if n == 8 else selected_experts(x, ids, w, ex.gate_up_proj, ex.down_proj)
        assert torch.equal(got, picked)
    with torch.no_grad():  # the trainer's dispatch: dense up to N = 16, then the Python loop
        trained = ex(x, ids, w)
        assert torch.equal(trained, ex._dense(x, ids, w) if n == 8 else ex._grouped(x, ids, w))
    torch.testing.assert_close(got, trained, rtol=RTOL, atol=ATOL)


@needs_cpu_grouped_mm
def test_router_ids_and_replay_do_not_depend_on_the_dispatch() -> None:
    cfg = tiny_config("qwen3_moe", vocab_size=64, initializer_range=0.2, num_hidden_layers=2,
                      num_experts=16, num_experts_per_tok=4)
    model = build_model(ModelSpec.from_hf(cfg), seed=2)
    tokens = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(6))
    spec = model.spec
    assert not prefer_dense(80, 4, 16, 2 * spec.moe_intermediate_size, spec.hidden_size, 4)  # served by gmm
    with torch.no_grad():
        trained = model(tokens, return_routed_experts=True)
    with torch.inference_mode():
        served = model(tokens, return_routed_experts=True)
        replay = model(tokens, routed_experts=served.routed_experts, return_routed_experts=True)
    assert torch.equal(served.routed_experts, trained.routed_experts)
    assert torch.equal(replay.routed_experts, served.routed_experts)
    assert torch.equal(replay.logits, served.logits)
    torch.testing.assert_close(served.logits, trained.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(served.logits.argmax(-1), trained.logits.argmax(-1))


@needs_cpu_grouped_mm
def test_operands_the_grouped_kernel_refuses_take_the_loop() -> None:
    ex = _experts(16, 130, 64, seed=7)  # fp32 hidden rows of 520 bytes: not a multiple of 16
    g = torch.Generator().manual_seed(7)
    x, ids = torch.randn(40, 130, generator=g), torch.randint(0, 16, (40, 4), generator=g)
    w = torch.softmax(torch.randn(40, 4, generator=g), dim=-1)
    assert not grouped_mm_fits(x, ex.gate_up_proj, ex.down_proj)
    assert not prefer_dense(40, 4, 16, 128, 130, 4)  # the selected experts, then, by the Python loop
    with torch.inference_mode():
        got = ex(x, ids, w)
        assert torch.equal(got, ex._grouped(x, ids, w))
        torch.testing.assert_close(got, ex._dense(x, ids, w), rtol=RTOL, atol=ATOL)
    aligned = _experts(4, 32, 16, seed=8)
    assert grouped_mm_fits(torch.randn(2, 32), aligned.gate_up_proj, aligned.down_proj)
