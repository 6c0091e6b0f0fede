"""HF <-> megatron layout on plain tensors (no megatron needed): every HF tensor of each
supported architecture survives fuse -> tensor-parallel shard -> unshard -> split."""

from __future__ import annotations

import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_state_dict
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.backends import TRAINERS, check_backend
from miles.trainer.megatron.available import transformer_engine_installed, unavailable_reason
from miles.trainer.megatron.build import check_parallel
from miles.trainer.megatron.layout import (
    fuse,
    fuse_qkv,
    split,
    split_qkv,
    targets,
    tp_shard,
    tp_unshard,
)

CASES = {
    "llama_tied": tiny_config("llama", tie_word_embeddings=True),
    "qwen2_bias": tiny_config("qwen2"),
    "qwen3_qknorm": tiny_config("qwen3"),
    "qwen3_moe": tiny_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]),
}


def _spec(name: str) -> ModelSpec:
    return ModelSpec.from_hf(CASES[name])


def _names(spec: ModelSpec, te: bool = False) -> set[str]:
    """The megatron names the local (or TE) spec creates, as megatron would list them."""
    return {t.mcore for t in targets(spec, lambda n: te and "layer_norm_weight" in n)}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_every_hf_tensor(name: str, tp: int) -> None:
    spec = _spec(name)
    hf = {k: v.clone() for k, v in hf_state_dict(build_model(spec, seed=3)).items()}
    ep = 2 if spec.is_moe else 1
    seen: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep):
        for t in targets(spec, _names(spec), ep_rank, ep):
            full = fuse(t.kind, [hf[n] for n in t.hf], spec)
            shards = [tp_shard(t.kind, full, r, tp) for r in range(tp)]
            if tp > 1 and t.kind != "copy" and full.dim() == 2:
                assert all(s.numel() * tp == full.numel() for s in shards), t.mcore
            back = split(t.kind, tp_unshard(t.kind, shards), spec)
            seen.update(zip(t.hf, back, strict=True))
    assert set(seen) == set(hf) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    for k, v in seen.items():
        assert torch.equal(v, hf[k]), k


def test_qkv_rows_are_grouped_per_kv_head() -> None:
    spec = _spec("qwen3_qknorm")  # 4 heads, 2 kv heads, head_dim 16
    hd, per = spec.head_dim, spec.num_heads // spec.num_kv_heads * spec.head_dim
    q = torch.arange(spec.num_heads * hd).float()
    k = 1000 + torch.arange(spec.num_kv_heads * hd).float()
    v = 2000 + torch.arange(spec.num_kv_heads * hd).float()
    fused = fuse_qkv(q, k, v, spec)
    group = per + 2 * hd
    for g in range(spec.num_kv_heads):
        blk = fused[g * group : (g + 1) * group]
        assert torch.equal(blk[:per], q[g * per : (g + 1) * per])
        assert torch.equal(blk[per : per + hd], k[g * hd : (g + 1) * hd])
        assert torch.equal(blk[per + hd :], v[g * hd : (g + 1) * hd])
    back = split_qkv(fused, spec)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    # tensor-parallel rank 1 of 2 holds exactly kv group 1
    assert torch.equal(tp_shard("qkv", fused, 1, 2), fused[group:])


def test_glu_shard_holds_matching_gate_and_up_rows() -> None:
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    full = torch.cat([gate, up])
    r1 = tp_shard("glu", full, 1, 2)
    assert torch.equal(r1, torch.cat([gate[4:], up[4:]]))
    assert torch.equal(tp_unshard("glu", [tp_shard("glu", full, r, 2) for r in range(2)]), full)


def test_te_names_replace_fused_norms() -> None:
    spec = _spec("qwen2_bias")
    local, te = _names(spec), _names(spec, te=True)
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te


def test_expert_parallel_ranks_hold_disjoint_experts() -> None:
    spec = _spec("qwen3_moe")
    per_rank = [{t.expert for t in targets(spec, set(), r, 4) if t.expert is not None} for r in range(4)]
    assert [sorted(s) for s in per_rank] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="expert_parallel_size=3"):
        targets(spec, set(), 0, 3)


def _mcfg(**kw: int) -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.backend = "megatron"
    for k, v in kw.items():
        setattr(cfg.megatron, k, v)
    return cfg


def test_config_checks_name_the_field() -> None:
    moe = _spec("qwen3_moe")
    assert check_parallel(_mcfg().megatron, moe, 1) == (1, 1, 1)
    cfg = _mcfg(expert_parallel_size=2)
    cfg.world_size = 2
    assert check_parallel(cfg.megatron, moe, 2) == (1, 2, 2)
    cfg = _mcfg(tensor_parallel_size=2)
    cfg.world_size = 4
    assert check_parallel(cfg.megatron, _spec("qwen2_bias"), 4) == (2, 1, 2)
    cfg = _mcfg(tensor_parallel_size=2, expert_parallel_size=2)
    cfg.world_size = 4
    if transformer_engine_installed():
        assert check_parallel(cfg.megatron, moe, 4) == (2, 2, 2)
    else:  # MoE + TP trains only with sequence parallelism, which needs TE's norms
        with pytest.raises(ConfigError, match="needs Transformer Engine"):
            check_parallel(cfg.megatron, moe, 4)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        check_parallel(_mcfg(pipeline_parallel_size=2).megatron, moe, 1)
    with pytest.raises(ConfigError, match="expert_parallel_size=2 needs a MoE"):
        check_parallel(_mcfg(expert_parallel_size=2).megatron, _spec("qwen2_bias"), 1)
    with pytest.raises(ConfigError, match="lora"):  # what megatron does not run: refused at load
        load_config(MilesConfig, None, ["trainer.backend=megatron", "trainer.lora.rank=4"])


@pytest.mark.skipif(unavailable_reason() is None, reason="megatron-core can run here")
def test_launch_check_says_why_megatron_cannot_run() -> None:
    with pytest.raises(ConfigError, match="trainer.backend='megatron' cannot run: .*"):
        check_backend(_mcfg(), _spec("qwen3_moe"), 1)
    check_backend(TrainerConfig(), None, 1)  # fsdp stays fine
    assert TRAINERS.names() == ["fsdp", "megatron"]
