"""Qwen2.5-VL-style family: logits vs transformers' Qwen2_5_VLForConditionalGeneration (fp32,
≤ 1e-5) with images through the vision tower (window and full attention, several images, a
two-frame grid), text-only rows, checkpoints both ways through miles' HF-layout loader, the
miles-defined MoE language side (checked against the dense reference with every expert equal
to the dense MLP), and M-RoPE positions against transformers' own index."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.hf_io import iter_checkpoint, load_hf_tensors, load_model, save_model
from miles.models.mrope import mrope_positions
from miles.models.qwen2_5_vl import VLCausalLM, image_tokens
from miles.models.registry import build_model

IMG, START, END = 100, 102, 103
GRIDS = torch.tensor([[1, 8, 12], [1, 6, 4], [2, 4, 4]])  # windows cut short, and two frames


def vl_config(**text: object) -> dict[str, object]:
    t: dict[str, object] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-5, bos_token_id=None,
        eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    t.update(text)
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "image_token_id": IMG, "video_token_id": 101, "vision_start_token_id": START, "vision_end_token_id": END,
        "tie_word_embeddings": False, "text_config": t,
        "vision_config": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                              temporal_patch_size=2, spatial_merge_size=2, window_size=16, out_hidden_size=64,
                              fullatt_block_indexes=[1], in_channels=3, initializer_range=0.1),
    }


def hf_vl(cfg: dict[str, object]) -> transformers.Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(**cfg)).eval()


def prompt_with_images(grids: torch.Tensor) -> torch.Tensor:
    n = image_tokens(grids, 2)
    ids = [5, 6, START, *[IMG] * n[0], END, 7, 8, 9, START, *[IMG] * n[1], END, 10, START, *[IMG] * n[2], END, 11, 12]
    return torch.tensor([ids])


def pixels_for(grids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


def hf_logits(ref: torch.nn.Module, ids: torch.Tensor, pix: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    return ref(input_ids=ids, pixel_values=pix, image_grid_thw=grids, mm_token_type_ids=(ids == IMG).int()).logits


def test_logits_match_transformers_with_images_and_round_trip(tmp_path) -> None:
    cfg = vl_config()
    ref = hf_vl(cfg)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert isinstance(ours, VLCausalLM) and ours.spec.vision is not None
    ids, pix = prompt_with_images(GRIDS), pixels_for(GRIDS)
    text = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_logits(ref, ids, pix, GRIDS)
        got = ours(ids, pixel_values=pix, image_grid_thw=GRIDS).logits
        assert (got - want).abs().max().item() <= 1e-5
        feats = torch.cat(ref.model.get_image_features(pix, GRIDS).pooler_output)
        assert (ours.image_features(pix, GRIDS) - feats).abs().max().item() <= 1e-5
        assert (ours(text).logits - ref(input_ids=text).logits).abs().max().item() <= 1e-5
    save_model(ours, tmp_path / "miles")
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "miles").eval()
    with torch.no_grad():
        assert (hf_logits(back, ids, pix, GRIDS) - got).abs().max().item() <= 1e-5


def test_mrope_positions_equal_transformers_rope_index() -> None:
    ref = hf_vl(vl_config())
    ids = prompt_with_images(GRIDS)
    want, delta = ref.model.get_rope_index(ids, mm_token_type_ids=(ids == IMG).int(), image_grid_thw=GRIDS)
    got, d = mrope_positions(ids[0], GRIDS, IMG, 2)
    assert torch.equal(got, want[:, 0]) and d == int(delta)


def test_engine_style_decode_over_the_offset_equals_full_forward() -> None:
    """Prefill with images, then decode text tokens at position T + delta on every axis: the
    logits equal one full forward (the offset the engine decodes with)."""
    spec = ModelSpec.from_hf(vl_config())
    model = build_model(spec, seed=2)
    ids, pix = prompt_with_images(GRIDS), pixels_for(GRIDS)
    pos, delta = mrope_positions(ids[0], GRIDS, IMG, 2)
    more = torch.tensor([[13, 14, 15]])
    full_ids = torch.cat((ids, more), dim=1)
    t = ids.shape[1]
    tail = torch.arange(t, t + 3) + delta
    full_pos = torch.cat((pos, tail.expand(3, 3)), dim=1).unsqueeze(1)
    with torch.no_grad():
        one = model(full_ids, pixel_values=pix, image_grid_thw=GRIDS).logits
        two = model(full_ids, pixel_values=pix, image_grid_thw=GRIDS, rope_position_ids=full_pos).logits
    assert torch.equal(one, two)


def test_moe_language_side_equals_dense_reference_when_experts_are_equal(tmp_path) -> None:
    """transformers has no Qwen2.5-VL MoE class: the miles-defined variant is checked against
    the dense reference with every expert set to the dense MLP (normalised top-k weights sum
    to 1, so the layer's output is that MLP's up to rounding), loaded through the HF loader."""
    dense = vl_config()
    ref = hf_vl(dense)
    moe = vl_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[])
    moe["architectures"] = ["Qwen2_5_VLMoeForConditionalGeneration"]
    moe["model_type"] = "qwen2_5_vl_moe"
    spec = ModelSpec.from_hf(moe)
    assert spec.moe_layers == (0, 1) and spec.num_experts == 4
    ours = build_model(spec, seed=5)
    ref.save_pretrained(tmp_path / "hf")
    g = torch.Generator().manual_seed(7)

    def as_moe():
        for name, t in iter_checkpoint(tmp_path / "hf"):
            if ".mlp." in name and name.startswith("model.layers."):
                pre, proj = name.split(".mlp.")
                for e in range(4):
                    yield f"{pre}.mlp.experts.{e}.{proj}", t
            else:
                yield name, t
        for layer in range(2):
            yield f"model.layers.{layer}.mlp.gate.weight", torch.randn(4, 64, generator=g)

    load_hf_tensors(ours, as_moe())
    ids, pix = prompt_with_images(GRIDS), pixels_for(GRIDS)
    with torch.no_grad():
        out = ours(ids, pixel_values=pix, image_grid_thw=GRIDS, return_routed_experts=True)
        assert (out.logits - hf_logits(ref, ids, pix, GRIDS)).abs().max().item() <= 1e-5
    assert out.routed_experts is not None and out.routed_experts.shape == (1, ids.shape[1], 2, 2)
    assert len(torch.unique(out.routed_experts)) > 1  # the random gate spreads tokens over experts
    save_model(ours, tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["text_config"]["num_experts"] == 4
    again = load_model(tmp_path / "moe")
    with torch.no_grad():
        assert torch.equal(again(ids, pixel_values=pix, image_grid_thw=GRIDS).logits, out.logits)


def test_placeholder_count_mismatch_is_refused_naming_both_counts() -> None:
    model = build_model(ModelSpec.from_hf(vl_config()), seed=0)
    ids = prompt_with_images(GRIDS)
    short = torch.cat((ids[:, :5], ids[:, 6:]), dim=1)  # one image token dropped (verl #1640's bug)
    with pytest.raises(ModelInputError, match="image"):
        model(short, pixel_values=pixels_for(GRIDS), image_grid_thw=GRIDS)
    with pytest.raises(ModelInputError, match="placeholder tokens"):
        model(short, pixel_values=pixels_for(GRIDS), image_grid_thw=GRIDS,
              rope_position_ids=torch.zeros(3, 1, short.shape[1], dtype=torch.long))


def test_bad_vision_config_names_the_key() -> None:
    cfg = vl_config()
    cfg["vision_config"]["hidden_act"] = "gelu"  # type: ignore[index]
    with pytest.raises(ConfigError, match="vision_config.hidden_act"):
        ModelSpec.from_hf(cfg)
    cfg = vl_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2]})
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelSpec.from_hf(cfg)
