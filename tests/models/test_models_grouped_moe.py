"""Fused MoE dispatch (models/grouped_moe.py): the padded sorted plan, and the grouped-GEMM
experts against the per-expert loop, forward and backward, and R3 replay through it."""

from __future__ import annotations

import pytest
import torch

from miles.models.config import ModelSpec
from miles.models.grouped_moe import ALIGN, _Combine, _Dispatch, grouped_swiglu_experts, plan_groups
from miles.models.moe import Experts
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(60)


def _cpu_grouped_mm_works() -> str | None:
    """torch's CPU grouped GEMM (a loop in ATen) lets the fused path's indexing be tested
    here; older builds have none."""
    try:
        a = torch.ones(ALIGN, ALIGN, dtype=torch.bfloat16, requires_grad=True)
        b = torch.ones(1, ALIGN, ALIGN, dtype=torch.bfloat16)
        y = torch._grouped_mm(a, b, offs=torch.tensor([ALIGN], dtype=torch.int32))
        y.backward(torch.ones_like(y))
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        return f"torch._grouped_mm unavailable on CPU in this torch: {exc}"
    return None


NO_CPU_GROUPED_MM = _cpu_grouped_mm_works()
needs_grouped_mm = pytest.mark.skipif(NO_CPU_GROUPED_MM is not None, reason=str(NO_CPU_GROUPED_MM))


def test_plan_puts_every_slot_in_its_experts_group() -> None:
    g = torch.Generator().manual_seed(0)
    n, k, e = 37, 3, 10
    ids = torch.randint(0, e - 2, (n, k), generator=g)  # experts 8 and 9 get no token
    ids[0] = torch.tensor([4, 4, 1])  # a repeated id
    plan = plan_groups(ids, e)
    offs = plan.offs.long()
    assert plan.offs.dtype == torch.int32 and offs.shape == (e,)
    assert int(offs[-1]) == plan.src.numel() and plan.src.numel() % ALIGN == 0
    starts = torch.cat([torch.zeros(1, dtype=torch.long), offs[:-1]])
    sizes = offs - starts
    assert bool((sizes >= ALIGN).all()) and bool((sizes[:-1] % ALIGN == 0).all())
    flat = ids.reshape(-1)
    rows = plan.slot_row
    assert rows.unique().numel() == n * k  # one row per slot
    assert bool((rows >= starts[flat]).all()) and bool((rows < offs[flat]).all())
    assert torch.equal(plan.src[rows], torch.arange(n * k) // k)  # the row reads its token
    pad = torch.ones(plan.src.numel(), dtype=torch.bool)
    pad[rows] = False
    assert bool((plan.src[pad] == n).all())  # every other row reads the zero row
    for j in range(e):  # within a group, slots keep their token order (a stable sort)
        mine = rows[flat == j]
        assert torch.equal(mine, mine.sort().values)


def test_dispatch_and_combine_backwards_are_their_adjoints() -> None:
    """The hand-written backwards (gathers, no index_add_) against autograd's numerical
    Jacobian, in float64: dispatch copies token rows to expert rows, combine sums them back."""
    g = torch.Generator().manual_seed(4)
    n, k, e, h = 9, 3, 5, 4
    ids = torch.randint(0, e, (n, k), generator=g)
    plan = plan_groups(ids, e)
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    ys = torch.randn(plan.src.numel(), h, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _Dispatch.apply(t, plan.src, plan.slot_row, k), (x,))
    assert torch.autograd.gradcheck(lambda t: _Combine.apply(t, plan.src, plan.slot_row, k), (ys,))
    # combine after dispatch gives each token k copies of itself
    torch.testing.assert_close(_Combine.apply(_Dispatch.apply(x, plan.src, plan.slot_row, k),
                                              plan.src, plan.slot_row, k), k * x)
    # the slot each padded row holds: the inverse of slot_row, N*k on padding rows
    assert torch.equal(plan.slot_of_row[plan.slot_row], torch.arange(n * k))
    assert int((plan.slot_of_row == n * k).sum()) == plan.src.numel() - n * k


def _experts(e: int, h: int, i: int, seed: int) -> Experts:
    ex = Experts(e, h, i)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
    return ex


def _run(ex: Experts, impl: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ex.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    ex.impl = impl
    y = ex(x, ids, w)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    grads = {"x": x.grad, "w": w.grad, "gate_up": ex.gate_up_proj.grad, "down": ex.down_proj.grad}
    return y.detach(), {n: t.detach().clone() for n, t in grads.items()}


@needs_grouped_mm
def test_grouped_mm_equals_the_loop_forward_and_backward() -> None:
    """bf16 (the kernel's only dtype): both paths against an fp32 loop on the same bf16
    values; the fused one is at least as close as the bf16 loop, up to a rounding step."""
    g = torch.Generator().manual_seed(1)
    e, h, i, n, k = 8, 32, 16, 29, 2
    ids = torch.randint(0, e - 1, (n, k), generator=g)  # expert 7 unused: its grads are 0
    x = torch.randn(n, h, generator=g)
    w = torch.rand(n, k, generator=g)
    ref = _experts(e, h, i, seed=2)
    y32, g32 = _run(ref, "loop", x.bfloat16().float(), ids, w.bfloat16().float())
    bf = _experts(e, h, i, seed=2).to(torch.bfloat16)
    y_loop, g_loop = _run(bf, "loop", x.bfloat16(), ids, w.bfloat16())
    y_mm, g_mm = _run(bf, "grouped_mm", x.bfloat16(), ids, w.bfloat16())
    scale = y32.abs().max()
    assert float((y_mm.float() - y32).abs().max()) <= 2 * float((y_loop.float() - y32).abs().max()) + 1e-2 * scale
    torch.testing.assert_close(y_mm.float(), y32, rtol=2e-2, atol=2e-2 * float(scale))
    for name, want in g32.items():
        tol = 3e-2 * float(want.abs().max())
        torch.testing.assert_close(g_mm[name].float(), want, rtol=3e-2, atol=tol, msg=name)
    assert float(g_mm["gate_up"][e - 1].abs().max()) == 0.0 and float(g_mm["down"][e - 1].abs().max()) == 0.0


@needs_grouped_mm
def test_grouped_swiglu_handles_one_token_and_all_slots_on_one_expert() -> None:
    ex = _experts(4, 16, 8, seed=3).to(torch.bfloat16)
    for ids in (torch.tensor([[2, 2]]), torch.full((5, 2), 3)):
        x = torch.randn(ids.shape[0], 16, dtype=torch.bfloat16)
        w = torch.full(ids.shape, 0.5, dtype=torch.bfloat16)
        got = grouped_swiglu_experts(x, ids, w, ex.gate_up_proj, ex.down_proj)
        ex.impl = "loop"
        want = ex(x, ids, w)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_grouped_mm
def test_r3_replay_through_grouped_mm_is_exact() -> None:
    """Given the ids live routing chose, the fused path reproduces the logits bit for bit."""
    cfg = tiny_config("qwen3_moe", vocab_size=64, initializer_range=0.2, hidden_size=32,
                      moe_intermediate_size=16)
    model = build_model(ModelSpec.from_hf(cfg), seed=5).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.experts.impl = "grouped_mm"
    ids = torch.randint(0, 64, (1, 23), generator=torch.Generator().manual_seed(6))
    live = model(ids, return_routed_experts=True)
    replay = model(ids, routed_experts=live.routed_experts)
    assert torch.equal(replay.logits, live.logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_mm_matches_loop_and_auto_captures_in_a_graph() -> None:
    dev = torch.device("cuda")
    e, h, i, n, k = 16, 128, 64, 300, 4
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, e, (n, k), generator=g).to(dev)
    x = torch.randn(n, h, generator=g).to(dev, torch.bfloat16)
    w = torch.rand(n, k, generator=g).to(dev, torch.bfloat16)
    ex = _experts(e, h, i, seed=8).to(dev, torch.bfloat16)
    # both bf16 paths against an fp32 loop on the same bf16 values (they round differently:
    # the fused path scales activations before the down projection, the loop after it)
    y32, g32 = _run(_experts(e, h, i, seed=8).to(dev, torch.bfloat16).float(), "loop", x.float(), ids, w.float())
    y_loop, _ = _run(ex, "loop", x, ids, w)
    y_mm, g_mm = _run(ex, "grouped_mm", x, ids, w)
    scale = float(y32.abs().max())
    assert float((y_mm.float() - y32).abs().max()) <= 2 * float((y_loop.float() - y32).abs().max()) + 1e-2 * scale
    for name, want in g32.items():
        torch.testing.assert_close(g_mm[name].float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()), msg=name)
    ex.impl = "auto"
    with torch.no_grad():
        ex(x[:4], ids[:4], w[:4])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ex(x[:4], ids[:4], w[:4])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ex(x[:4], ids[:4], w[:4]))
