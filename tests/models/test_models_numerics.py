"""miles models vs transformers: identical logits (fp32) on random tiny configs, both IO directions."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from miles.models.config import ModelSpec
from miles.models.hf_io import load_model, save_model
from miles.models.masks import padded_causal_mask
from miles.models.presets import tiny_config

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


def random_config(arch: str, seed: int) -> dict:
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    cfg = tiny_config(
        arch,
        vocab_size=rng.choice([61, 128]),
        hidden_size=rng.choice([32, 48]),
        intermediate_size=rng.choice([40, 64]),
        num_hidden_layers=rng.choice([2, 3]),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([1, heads]),
        head_dim=rng.choice([8, 16]),
        rope_theta=rng.choice([10000.0, 1e6]),
        tie_word_embeddings=rng.random() < 0.5,
        initializer_range=0.2,
    )
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = rng.random() < 0.5
    if arch == "qwen3_moe":
        cfg.update(
            num_experts=rng.choice([4, 6]),
            num_experts_per_tok=rng.choice([1, 2]),
            norm_topk_prob=rng.random() < 0.5,
            decoder_sparse_step=rng.choice([1, 2]),
            mlp_only_layers=[0] if rng.random() < 0.5 else [],
        )
    return cfg


def hf_model(cfg: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="eager")
    with torch.no_grad():  # non-trivial biases and norms so every parameter is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_transformers_both_ways(arch: str, seed: int, tmp_path) -> None:
    cfg = random_config(arch, seed)
    ref = hf_model(cfg, seed)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.spec.num_moe_layers == (0 if arch != "qwen3_moe" else len(ours.spec.moe_layers))
    ids = torch.randint(0, cfg["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert (got - want).abs().max().item() <= 1e-5

    # what miles saves, transformers loads and computes the same logits from
    save_model(ours, tmp_path / "miles", max_shard_bytes=20_000 if seed else None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "miles", attn_implementation="eager")
    with torch.no_grad():
        assert (back(input_ids=ids).logits - got).abs().max().item() <= 1e-5
    if seed:
        assert (tmp_path / "miles" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_packed_and_padded_layouts_equal_separate_sequences(arch: str) -> None:
    from miles.models.registry import build_model

    spec = ModelSpec.from_hf(tiny_config(arch, vocab_size=64, initializer_range=0.2))
    model = build_model(spec, seed=3)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in (5, 9, 3)]
    with torch.no_grad():
        alone = [model(s[None]).logits[0] for s in seqs]
        packed_ids = torch.cat(seqs)[None]
        cu = torch.tensor([0, 5, 14, 17])
        packed = model(packed_ids, cu_seqlens=cu).logits[0]
        # left-padded batch with explicit positions
        t = max(len(s) for s in seqs)
        ids = torch.zeros(3, t, dtype=torch.long)
        valid = torch.zeros(3, t, dtype=torch.bool)
        pos = torch.zeros(3, t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, t - len(s) :] = s
            valid[i, t - len(s) :] = True
            pos[i, t - len(s) :] = torch.arange(len(s))
        padded = model(ids, pos, attention_mask=padded_causal_mask(valid)).logits
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    for i, s in enumerate(seqs):
        assert torch.allclose(padded[i, t - len(s) :], alone[i], atol=1e-5)
