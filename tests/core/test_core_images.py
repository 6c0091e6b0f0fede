"""core/images.py: the patch layout equals transformers' Qwen2-VL image processor (resize off,
same normalisation), placeholder expansion and the mismatch count, and the wire form."""

from __future__ import annotations

import numpy as np
import pytest

from miles.core.errors import ProtocolError
from miles.core.images import (
    ImageInput,
    expand_placeholders,
    image_token_mismatches,
    patchify,
)

IMG = 9


def test_patches_equal_the_transformers_processor_layout() -> None:
    transformers = pytest.importorskip("transformers")
    proc_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    proc = proc_cls(do_resize=False, do_rescale=False, do_normalize=True, image_mean=[0.5] * 3,
                    image_std=[0.5] * 3, patch_size=4, temporal_patch_size=2, merge_size=2)
    img = np.random.default_rng(0).random((16, 24, 3)).astype(np.float32)
    want = proc(images=[img], return_tensors="np", input_data_format="channels_last")
    got = patchify(img, patch=4, temporal=2, merge=2)
    assert np.array_equal(got.grid, want["image_grid_thw"])
    assert np.abs(got.pixels - want["pixel_values"]).max() <= 1e-6


def test_expansion_and_mismatch_count() -> None:
    a, b = patchify(np.zeros((8, 16, 3)), 4, 2, 2), patchify(np.ones((8, 8, 3)), 4, 2, 2)
    both = ImageInput.concat([a, b])
    assert both.tokens(2) == [2, 1]
    ids = expand_placeholders([1, IMG, 2, IMG, 3], both.tokens(2), IMG)
    assert ids == [1, IMG, IMG, 2, IMG, 3]
    assert image_token_mismatches(ids, both, IMG, 2) == 0
    assert image_token_mismatches([1, IMG, 2, IMG, IMG, 3], both, IMG, 2) == 1  # text cuts the first image short
    assert image_token_mismatches([1, IMG, IMG, 2, 3], both, IMG, 2) == 1  # one token short
    assert image_token_mismatches(ids, None, IMG, 2) == 3  # images missing
    with pytest.raises(ProtocolError, match="2 image placeholder"):
        expand_placeholders([IMG, IMG], [2], IMG)


def test_wire_form_keeps_arrays_and_refuses_lists() -> None:
    a = patchify(np.zeros((8, 8, 3)), 4, 2, 2)
    d = a.to_wire()
    assert d["pixels"] is a.pixels  # the codec sends this very buffer as a frame
    assert ImageInput.from_wire(d).digest() == a.digest()
    with pytest.raises(ProtocolError, match="zero-copy frames"):
        ImageInput.from_wire({"pixels": a.pixels.tolist(), "grid": a.grid})
    with pytest.raises(ProtocolError, match="hold 4 patches"):
        ImageInput(np.zeros((3, 96), np.float32), np.array([[1, 2, 2]]))


def test_a_sample_with_images_round_trips_through_the_http_json_form() -> None:
    from miles.rollout.types import Sample
    from miles.sessions.openai_api import sample_from_json, sample_to_json

    a = patchify(np.random.default_rng(1).random((8, 16, 3)), 4, 2, 2)
    s = Sample(prompt_ids=[1, IMG, IMG, 2], response_ids=[3], loss_mask=[1], rollout_logprobs=[-0.5], versions=[0],
               images=a)
    import json

    back = sample_from_json(json.loads(json.dumps(sample_to_json(s))))
    assert back.images is not None and back.images.digest() == a.digest()
