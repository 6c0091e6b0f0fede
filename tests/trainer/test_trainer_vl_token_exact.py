"""Images through the whole path, token for token: chat messages with images go through the
session store (template rendered, placeholders expanded once), the torch engine samples with
them, the exported sample crosses the wire with its pixels as out-of-band frames, and the
trainer's packed / padded / per-sequence forwards see exactly the engine's ids and image
features: logprobs equal the engine's within fp32 rounding, 0 image-token mismatches. A
trainer whose ids were expanded differently from the engine's is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.core.images import ImageInput, image_token_mismatches, patchify
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.rollout.tito.client import EngineOutput, LocalSessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.types import Sample
from miles.trainer.batch import TrainSample
from miles.trainer.forward import packed_forward, padded_forward
from miles.trainer.packing import pack
from miles.trainer.true_on_policy import invariant_forward
from miles.transport.codec import REPLY, decode, encode

VOCAB, IMG, MERGE = 111, 110, 2


def shape_image(seed: int, h: int, w: int) -> ImageInput:
    return patchify(np.random.default_rng(seed).random((h, w, 3)), patch=4, temporal=2, merge=MERGE)


def user(text: str, img: ImageInput) -> dict[str, object]:
    return {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}


@pytest.fixture
async def stack(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok", vision=True)
    assert tok.token_to_id("<|image_pad|>") == IMG
    store = SessionStore(tok)
    store.enable_images(IMG, MERGE)
    model = build_model(ModelSpec.from_hf(tiny_config("qwen2_5_vl", vocab_size=VOCAB, initializer_range=0.1)), seed=3)
    eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=512, kv_budget_tokens=4000))

    async def engine_fn(ids: list[int], sampling: dict[str, object], images: ImageInput | None = None) -> EngineOutput:
        r = await eng.generate(GenerateRequest(ids, SamplingParams(temperature=1.0, max_new_tokens=6, seed=5),
                                               images=images))
        return EngineOutput(r.output_ids, r.logprobs, r.finish_reason, r.versions)

    yield LocalSessionClient(store, engine_fn), model
    await eng.close()


def to_train(s: Sample) -> TrainSample:
    """Through the wire as the trainer receives it: every array an out-of-band frame."""
    frames = encode(REPLY, 1, "trainer", {"samples": [s.to_wire()]})
    assert any(isinstance(f, np.ndarray) and f is s.images.pixels for f in frames[1:])  # type: ignore[union-attr]
    wire = decode([bytes(memoryview(f)) if isinstance(f, np.ndarray) else f for f in frames]).body
    d = wire["samples"][0]
    back = Sample.from_wire(d)
    assert back.images is not None and np.array_equal(back.images.pixels, s.images.pixels)  # type: ignore[union-attr]
    return TrainSample(d["prompt_ids"], d["response_ids"], 1.0, loss_mask=d["loss_mask"],
                       rollout_logprobs=d["rollout_logprobs"], pixels=d["images"]["pixels"],
                       image_grid=d["images"]["grid"])


async def test_two_turn_session_with_a_second_image_is_token_exact_in_the_trainer(stack) -> None:
    client, model = stack
    samples = []
    for k in range(3):
        sid = await client.create_session()
        a, b = shape_image(10 + k, 16, 24), shape_image(20 + k, 8, 16)
        first = [user("Colour?", a)]
        r1 = await client.chat(sid, first)
        await client.chat(sid, [*first, r1["message"], user("And now?", b)])
        [s] = await client.export(sid)
        await client.close(sid)
        assert s.images is not None and s.images.count == 2
        assert image_token_mismatches(s.ids, s.images, IMG, MERGE) == 0
        assert s.ids.count(IMG) == sum(a.tokens(MERGE) + b.tokens(MERGE))
        samples.append(to_train(s))
    mb = pack(samples, list(range(len(samples))))
    want = torch.from_numpy(np.concatenate([s.rollout_logprobs for s in samples]))
    sampled = torch.from_numpy(np.concatenate([s.loss_mask for s in samples])) > 0
    with torch.no_grad():
        for fwd in (packed_forward, padded_forward, invariant_forward):
            got = fwd(model, mb, temperature=1.0, replay=False, with_entropy=False).logp
            assert (got - want)[sampled].abs().max().item() <= 1e-4  # fp32: engine prefill/decode vs one forward


async def test_a_trainer_expansion_that_differs_from_the_engines_is_refused(stack) -> None:
    client, model = stack
    sid = await client.create_session()
    await client.chat(sid, [user("Colour?", shape_image(1, 16, 16))])
    [s] = await client.export(sid)
    t = to_train(s)
    ids = list(t.prompt_ids)
    at = ids.index(IMG)
    t.prompt_ids = np.array(ids[:at] + ids[at + 1:])  # one placeholder fewer than the engine fed
    assert image_token_mismatches(list(t.prompt_ids) + list(t.response_ids), s.images, IMG, MERGE) == 1
    with torch.no_grad(), pytest.raises(ModelInputError, match="image"):
        packed_forward(model, pack([t], [0]), temperature=1.0, replay=False, with_entropy=False)


async def test_images_refused_without_a_vision_model(tmp_path) -> None:
    from miles.core.errors import SessionError

    store = SessionStore(tiny_tokenizer(tmp_path / "tok", vision=True))
    with pytest.raises(SessionError, match="not a vision-language model"):
        store.prepare_one([user("hi", shape_image(0, 8, 8))])


async def test_moe_vl_routing_recorded_over_image_tokens_replays_in_the_trainer() -> None:
    """R3 with images: the engine records every token's experts (image placeholders included),
    the trainer replays them and gets the engine's logprobs."""
    model = build_model(ModelSpec.from_hf(tiny_config("qwen2_5_vl_moe", vocab_size=VOCAB, initializer_range=0.1)),
                        seed=4)
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=256))
    try:
        img = shape_image(3, 16, 24)
        ids = [5, 6, 108, *[IMG] * img.tokens(MERGE)[0], 109, 7, 8]
        r = await eng.generate(GenerateRequest(ids, SamplingParams(temperature=1.0, max_new_tokens=6, seed=2),
                                               images=img, return_routed_experts=True))
    finally:
        await eng.close()
    assert r.routed_experts is not None and r.routed_experts.shape[0] in (len(ids) + len(r.output_ids),
                                                                         len(ids) + len(r.output_ids) - 1)
    t = TrainSample(ids, r.output_ids, 1.0, rollout_logprobs=r.logprobs, routed_experts=r.routed_experts,
                    pixels=img.pixels, image_grid=img.grid)
    with torch.no_grad():
        got = packed_forward(model, pack([t], [0], replay=True), temperature=1.0, replay=True, with_entropy=False).logp
    assert (got - torch.tensor(r.logprobs)).abs().max().item() <= 1e-4
