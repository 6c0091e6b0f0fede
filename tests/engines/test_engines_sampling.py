"""Batched seeded sampling: the ids `torch.multinomial` draws with each row's generator, one
kernel per sampled row, and a row's draw does not depend on the rows sampled beside it."""

from __future__ import annotations

import pytest
import torch

from miles.engines.base import SamplingParams
from miles.engines.sampling import _truncate, choose_tokens, make_generator
from miles.models.logprobs import token_logprobs

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the H200 check of the same stream)")])]


def one_by_one(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """Reference: argmax for greedy rows, else torch.multinomial with the row's own generator."""
    out = []
    for row, p, gen in zip(logits, params, gens, strict=True):
        if p.temperature <= 0:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(_truncate(row.float() / p.temperature, p.top_k, p.top_p), dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)[0]))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [97, 2048, 151936])
def test_batched_draw_equals_multinomial_per_row(device: str, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9),
                              (1.0, 0, 1.0), (1.0, 0, 1.0), (0.0, 0, 1.0), (2.0, 50, 0.95), (1.0, 0, 1.0),
                              (0.5, 0, 1.0), (1.0, 0, 1.0)]]
    dev = torch.device(device)
    gens = [make_generator(100 + i, dev) if p.temperature > 0 else None for i, p in enumerate(params)]
    ref_gens = [make_generator(100 + i, dev) for i in range(len(params))]
    for _ in range(3):  # generators advance per draw and stay in step with the reference's
        logits = (torch.randn(len(params), vocab, generator=g) * 3).to(device)
        ids, lps = choose_tokens(logits, params, gens)
        assert ids == one_by_one(logits, params, ref_gens)
        temps = torch.tensor([[p.temperature] for p in params], device=device)
        want = token_logprobs(logits, torch.tensor(ids, device=device), temps)
        assert torch.allclose(torch.tensor(lps), want.cpu(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_draw_does_not_depend_on_its_neighbours(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 512, generator=g) * 2).to(device)
    sp = SamplingParams(temperature=1.0)
    alone = [choose_tokens(logits[i : i + 1], [sp], [make_generator(i, logits.device)])[0][0] for i in range(6)]
    order = [4, 0, 5, 2, 1, 3]
    together, _ = choose_tokens(logits[order], [sp] * 6, [make_generator(i, logits.device) for i in order])
    assert together == [alone[i] for i in order]


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_the_distribution(seeded: bool) -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = probs.log().expand(4000, -1).contiguous()
    gens = [make_generator(i, logits.device) if seeded else None for i in range(4000)]
    ids, _ = choose_tokens(logits, [SamplingParams(temperature=1.0)] * 4000, gens, make_generator(7, logits.device))
    freq = torch.bincount(torch.tensor(ids), minlength=5).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_share_one_draw_and_leave_seeded_rows_alone(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 300, generator=g) * 2).to(device)
    dev = torch.device(device)
    params = [SamplingParams(temperature=1.0, seed=i if i % 3 == 0 else None) for i in range(8)]

    def draw(shared_seed: int) -> list[int]:
        gens = [make_generator(p.seed, dev) if p.seed is not None else None for p in params]
        return choose_tokens(logits, params, gens, make_generator(shared_seed, dev))[0]

    a, b, c = draw(1), draw(1), draw(2)
    assert a == b  # the engine's generator alone decides the unseeded rows
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    ref = one_by_one(logits[seeded], [params[i] for i in seeded], [make_generator(i, dev) for i in seeded])
    assert [a[i] for i in seeded] == [c[i] for i in seeded] == ref
    assert [a[i] for i in range(8) if i not in seeded] != [c[i] for i in range(8) if i not in seeded]


def test_non_finite_logits_are_an_error() -> None:
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        choose_tokens(logits, [SamplingParams(temperature=0.0)] * 2, [None, None])


@pytest.mark.parametrize("device", DEVICES)
def test_all_rows_sampled_with_truncation_equal_multinomial_and_leave_the_logits(device: str) -> None:
    """Every row sampling (the RL case) takes the path without a row index; truncation must then
    work on a copy, not on the caller's logits (e.g. a decode graph's static output)."""
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(1.0, 5, 1.0), (1.0, 0, 0.9), (1.0, 0, 1.0), (1.0, 20, 0.95)]]  # T = 1: scaled is the logits
    dev = torch.device(device)
    logits = (torch.randn(len(params), 2048, generator=g) * 3).to(device)
    before = logits.clone()
    ids, _ = choose_tokens(logits, params, [make_generator(10 + i, dev) for i in range(len(params))])
    assert ids == one_by_one(logits, params, [make_generator(10 + i, dev) for i in range(len(params))])
    assert torch.equal(logits, before)
