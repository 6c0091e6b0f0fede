"""The torch engine serving a vision-language model: prompts whose image placeholders are
expanded once (core/images.py) generate the tokens a full forward over prompt + output with
the same images predicts (greedy, fp32), logprobs within fp32 rounding; batched rows with and
without images; a session's second turn adds a second image over the cached first turn; a
misexpanded prompt is refused naming the mismatch; a GRPO-style group of one image never
shares KV across other images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.core.errors import EngineError
from miles.core.images import ImageInput, expand_placeholders, patchify
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.qwen2_5_vl import VLCausalLM
from miles.models.registry import build_model

VOCAB = 97
IMG, START, END = VOCAB - 1, VOCAB - 3, VOCAB - 2


def vl_model(seed: int = 0) -> VLCausalLM:
    model = build_model(ModelSpec.from_hf(tiny_config("qwen2_5_vl", vocab_size=VOCAB, initializer_range=0.15)),
                        seed=seed)
    assert isinstance(model, VLCausalLM)
    return model


def image(seed: int, h: int = 16, w: int = 24) -> ImageInput:
    return patchify(np.random.default_rng(seed).random((h, w, 3)), patch=4, temporal=2, merge=2)


def prompt(text: list[int], imgs: ImageInput) -> list[int]:
    raw = [*text[:2], START, IMG, END, *text[2:]]
    return expand_placeholders(raw, imgs.tokens(2), IMG)


def full_logprobs(model: VLCausalLM, ids: list[int], imgs: ImageInput | None, n_out: int) -> torch.Tensor:
    kw = {} if imgs is None else {"pixel_values": torch.from_numpy(imgs.pixels),
                                  "image_grid_thw": torch.from_numpy(imgs.grid)}
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **kw).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    t = len(ids)
    return lp[torch.arange(t - n_out - 1, t - 1), torch.tensor(ids[t - n_out:])]


@pytest.fixture
async def vl_engine():
    model = vl_model()
    eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=256, kv_budget_tokens=4000))
    yield eng, model
    await eng.close()


async def test_greedy_tokens_and_logprobs_equal_a_full_forward_with_images(vl_engine) -> None:
    eng, model = vl_engine
    a, b = image(1), image(2, 8, 8)
    reqs = [
        GenerateRequest(prompt([3, 4, 5, 6], a), SamplingParams(temperature=0.0, max_new_tokens=8), images=a),
        GenerateRequest(prompt([7, 8, 9], b), SamplingParams(temperature=0.0, max_new_tokens=8), images=b),
        GenerateRequest([10, 11, 12, 13], SamplingParams(temperature=0.0, max_new_tokens=8)),  # text only
    ]
    import asyncio
    res = await asyncio.gather(*(eng.generate(r) for r in reqs))
    for r, out in zip(reqs, res, strict=True):
        ids = r.input_ids + out.output_ids
        want = full_logprobs(model, ids, r.images, len(out.output_ids))
        got = torch.tensor(out.logprobs)
        assert (got - want).abs().max().item() <= 1e-4  # fp32, prefill + decode vs one forward
        # greedy: each sampled token is the argmax of the full forward's logits at its position
        kw = {} if r.images is None else {"pixel_values": torch.from_numpy(r.images.pixels),
                                          "image_grid_thw": torch.from_numpy(r.images.grid)}
        with torch.no_grad():
            logits = model(torch.tensor([ids]), **kw).logits[0]
        t = len(ids)
        assert logits[t - len(out.output_ids) - 1: t - 1].argmax(-1).tolist() == out.output_ids


async def test_second_turn_adds_an_image_over_the_cached_first_turn(vl_engine) -> None:
    eng, model = vl_engine
    a, b = image(3), image(4, 8, 16)
    s = SamplingParams(temperature=0.0, max_new_tokens=5)
    first = prompt([3, 4, 5], a)
    r1 = await eng.generate(GenerateRequest(first, s, session_key="conv", images=a))
    turn2 = first + r1.output_ids + expand_placeholders([20, START, IMG, END, 21], b.tokens(2), IMG)
    both = ImageInput.concat([a, b])
    r2 = await eng.generate(GenerateRequest(turn2, s, session_key="conv", images=both))
    assert r2.cached_tokens > len(first)  # the first turn's KV (its image included) was reused
    want = full_logprobs(model, turn2 + r2.output_ids, both, len(r2.output_ids))
    assert (torch.tensor(r2.logprobs) - want).abs().max().item() <= 1e-4
    await eng.end_session("conv")


async def test_misexpanded_placeholders_and_images_on_text_models_are_refused(vl_engine) -> None:
    eng, _ = vl_engine
    a = image(5)
    ids = prompt([3, 4], a)
    short = ids[:4] + ids[5:]  # one image token lost (the count bug of verl #1640)
    with pytest.raises(EngineError, match="do not line up"):
        await eng.generate(GenerateRequest(short, SamplingParams(max_new_tokens=2), images=a))
    with pytest.raises(EngineError, match="do not line up"):
        await eng.generate(GenerateRequest(ids, SamplingParams(max_new_tokens=2)))  # images missing
    text = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=VOCAB)), seed=0)
    plain = TorchEngine(text, EngineConfig(max_batch_size=2, max_seq_len=64))
    try:
        with pytest.raises(EngineError, match="not a vision-language model"):
            await plain.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), images=a))
    finally:
        await plain.close()


async def test_equal_ids_with_other_pixels_never_share_kv() -> None:
    """Two prompts with identical (expanded) ids but different pixels, admitted together with
    prompt sharing on: each gets its own image's continuation."""
    model = vl_model(seed=1)
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=128, share_prompts=True))
    try:
        a, b = image(6), image(7)
        ids = prompt([3, 4, 5], a)
        assert ids == prompt([3, 4, 5], b)
        import asyncio
        s = SamplingParams(temperature=0.0, max_new_tokens=6)
        ra, rb = await asyncio.gather(eng.generate(GenerateRequest(ids, s, images=a)),
                                      eng.generate(GenerateRequest(ids, s, images=b)))
        for imgs, r in ((a, ra), (b, rb)):
            want = full_logprobs(model, ids + r.output_ids, imgs, len(r.output_ids))
            assert (torch.tensor(r.logprobs) - want).abs().max().item() <= 1e-4
    finally:
        await eng.close()


async def test_the_image_placeholder_is_never_sampled_and_logprobs_keep_the_full_softmax() -> None:
    model = vl_model(seed=2)
    with torch.no_grad():  # the head now prefers the placeholder by far
        model.lm_head.weight[IMG] = model.lm_head.weight[IMG] * 0 + 3.0 * model.model.norm.weight
    eng = TorchEngine(model, EngineConfig(max_batch_size=2, max_seq_len=128))
    try:
        a = image(8)
        ids = prompt([3, 4], a)
        for temp in (0.0, 1.0):
            r = await eng.generate(GenerateRequest(ids, SamplingParams(temperature=temp, max_new_tokens=6, seed=1),
                                                   images=a))
            assert IMG not in r.output_ids
            want = full_logprobs(model, ids + r.output_ids, a, len(r.output_ids))
            assert (torch.tensor(r.logprobs) - want).abs().max().item() <= 1e-4
    finally:
        await eng.close()
