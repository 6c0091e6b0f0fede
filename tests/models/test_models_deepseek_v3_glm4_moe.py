"""GLM-4.5 (glm4_moe) and DeepSeek-V3 (deepseek_v3): logits and round trips vs transformers,
the MLA latent KV cache in the torch engine, R3 recorded by the engine and replayed by the
FSDP2 trainer, true on-policy (batch-invariant) mode, SGLang's routed-expert decoding, and refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import transformers

from miles.core.errors import ConfigError
from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.kv_cache import RowPool
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import load_model, save_model
from miles.models.logprobs import token_logprobs
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.fsdp import FSDPTrainer

from ..recipes.test_recipes_true_on_policy import _max_diff
from .test_models_numerics import hf_model

ARCHS = ["glm4_moe", "deepseek_v3"]
VARIANTS = {
    "glm4_moe": [{}, {"n_group": 1, "topk_group": 1, "use_qk_norm": False, "first_k_dense_replace": 0}],
    "deepseek_v3": [
        {},
        {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
         "max_position_embeddings": 64},
    ],
}


def _hf(cfg: dict, seed: int) -> torch.nn.Module:
    ref = hf_model(cfg, seed)
    with torch.no_grad():  # a non-zero bias correction, so the biased choice is exercised
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return ref


@pytest.mark.parametrize(("arch", "variant"), [(a, i) for a in ARCHS for i in range(len(VARIANTS[a]))])
def test_logits_match_transformers_both_ways(arch: str, variant: int, tmp_path) -> None:
    cfg = tiny_config(arch, initializer_range=0.2, num_hidden_layers=3, **VARIANTS[arch][variant])
    ref = _hf(cfg, variant)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    first = cfg["first_k_dense_replace"]
    assert ours.spec.moe_layers == tuple(range(first, 3))
    ids = torch.randint(0, cfg["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(variant))
    with torch.no_grad():
        got = ours(ids).logits
        assert (got - ref(input_ids=ids).logits).abs().max().item() <= 1e-5
    save_model(ours, tmp_path / "miles", max_shard_bytes=30_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "miles", attn_implementation="eager")
    with torch.no_grad():
        assert (back(input_ids=ids).logits - got).abs().max().item() <= 1e-5


def test_mtp_layers_in_a_checkpoint_are_skipped(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = build_model(ModelSpec.from_hf(tiny_config("deepseek_v3")), seed=0)
    save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)  # layer 2 of a 2-layer model: MTP
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(load_model(tmp_path).model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_mla_cache_holds_the_latent_not_expanded_kv() -> None:
    spec = ModelSpec.from_hf(tiny_config("deepseek_v3"))
    pool = RowPool(spec, rows=2, max_seq_len=8, dtype=torch.bfloat16, device=torch.device("cpu"))
    m = spec.mla
    assert m is not None
    latent = spec.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
    expanded = spec.num_layers * spec.num_heads * (m.qk_head_dim + m.v_head_dim) * 2
    assert pool.bytes_per_token() == latent
    assert pool.bytes_per_token() <= 0.3 * expanded


def _engine_model(arch: str) -> torch.nn.Module:
    # top-1 with renormalisation: gate weights are exactly routed_scaling_factor whatever the
    # scores, so under R3 only the choice of expert matters (what replay must reproduce)
    cfg = tiny_config(arch, vocab_size=97, initializer_range=0.15, num_hidden_layers=3,
                      num_experts_per_tok=1, topk_group=1)
    return build_model(ModelSpec.from_hf(cfg), seed=3)


@pytest.mark.parametrize("arch", ARCHS)
async def test_engine_records_routes_and_fsdp_replay_reproduces_logprobs(arch: str) -> None:
    await engine_r3_round_trip(_engine_model(arch), seed=3)


async def engine_r3_round_trip(model: torch.nn.Module, seed: int) -> None:
    """Generate in the torch engine with routed-expert recording, check the recorded ids and
    logprobs against one full forward, then train on that rollout with R3 replay: routing
    overlap 1.0 and logprobs within 1e-4. `model` must be `build_model(spec, seed=seed)`."""
    spec = model.spec
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, cuda_graphs=False))
    prompts = [[5, 6, 7, 8, 9], [1, 2], [40, 41, 42, 43], [11, 12, 13]]
    try:
        results = await asyncio.gather(*(
            eng.generate(GenerateRequest(
                input_ids=p, return_routed_experts=True,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=5 + i, seed=i)))
            for i, p in enumerate(prompts)
        ))
    finally:
        await eng.close()
    samples = []
    for i, (p, res) in enumerate(zip(prompts, results, strict=True)):
        re = res.routed_experts
        assert re is not None and re.dtype == np.uint8  # 8 experts: the smallest id dtype
        full = torch.tensor([p + res.output_ids])
        with torch.no_grad():  # the engine (MLA: over its latent cache) equals one full forward
            live = model(full, return_routed_experts=True)
        assert np.array_equal(live.routed_experts[0, : re.shape[0]].numpy(), re)
        lp = token_logprobs(live.logits[0, len(p) - 1 : -1], torch.tensor(res.output_ids), 1.0)
        assert torch.allclose(lp, torch.tensor(res.logprobs), atol=1e-5)
        samples.append(TrainSample(
            prompt_ids=np.array(p), response_ids=np.array(res.output_ids), reward=float(i % 2),
            group_index=i // 2, rollout_logprobs=np.array(res.logprobs, np.float32),
            routed_experts=re[: full.shape[1] - 1], versions=np.zeros(len(res.output_ids), np.int64),
        ))
    batch = TrainBatch(samples)
    cfg = TrainerConfig()
    cfg.device, cfg.micro_batch_tokens, cfg.routing_replay = "cpu", 64, True
    trainer = FSDPTrainer(cfg, spec, 0, 1, seed=seed)  # the engine model's weights
    try:
        m = trainer.train_step(batch)
    finally:
        trainer.close()
    assert m["train/routing_overlap"] == 1.0
    assert m["train/train_rollout_logprob_abs_diff_max"] < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
async def test_true_on_policy_engine_and_trainer_logprobs_are_bitwise_equal(arch: str, dtype: torch.dtype) -> None:
    """A real rollout (engine over its KV cache, MLA: the latent cache) then a trainer step
    with R3, twice with a weight sync between: exact 0 in the batch-invariant mode."""
    spec = ModelSpec.from_hf(tiny_config(arch, vocab_size=64, initializer_range=0.1, n_routed_experts=16))
    assert await _max_diff(spec, True, dtype) == 0.0


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"architectures": ["Qwen3_5MoeForCausalLM"]}, "unknown model architecture"),
        (tiny_config("deepseek_v3", scoring_func="softmax"), "scoring_func='softmax'"),
        (tiny_config("glm4_moe", n_group=3), "n_group=3"),
        (tiny_config("deepseek_v3", q_lora_rank=0), "q_lora_rank=0"),
    ],
)
def test_refusals_name_the_reason(cfg: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSpec.from_hf(cfg)


@pytest.mark.parametrize(
    ("arch", "kw", "match"),
    [
        ("deepseek_v3", {}, "does not map deepseek_v3"),
        ("glm4_moe", {}, "does not map glm4_moe"),
        ("qwen3_next", {}, "does not map qwen3_next"),
        ("gpt_oss", {}, "does not map gpt_oss"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, "sliding_window=8"),
    ],
)
def test_megatron_backend_refuses_what_it_does_not_map(arch: str, kw: dict, match: str) -> None:
    from miles.core.schema.trainer import MegatronConfig
    from miles.trainer.megatron.build import check_parallel

    with pytest.raises(ConfigError, match=match):
        check_parallel(MegatronConfig(), ModelSpec.from_hf(tiny_config(arch, **kw)), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_client_reads_deepseek_style_moe_layout_and_routes(arch: str) -> None:
    """SGLang serves these natively; its routed_experts (int32, one row per decoder layer)
    decode to the MoE layers only, in the smallest id dtype."""
    import base64

    from miles.engines.sglang_wire import ModelFacts, decode_routed_experts

    cfg = tiny_config(arch, num_hidden_layers=3, first_k_dense_replace=1)
    facts = ModelFacts.from_config(cfg)
    assert (facts.num_experts, facts.top_k, facts.moe_layers) == (8, 2, (1, 2))
    raw = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 8
    got = decode_routed_experts(base64.b64encode(raw.tobytes()).decode(), 5, facts, "test")
    assert got.dtype == np.uint8 and np.array_equal(got, raw[:, 1:])


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next"])
def test_fp8_is_refused_for_families_outside_the_fp8_contract(arch: str) -> None:
    from miles.models.fp8_layout import with_fp8

    with pytest.raises(ConfigError, match=f"{arch} under FP8"):
        build_model(with_fp8(ModelSpec.from_hf(tiny_config(arch)), (16, 16)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 bf16 check)")
@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
async def test_true_on_policy_bitwise_equal_on_cuda_bf16(arch: str) -> None:
    spec = ModelSpec.from_hf(tiny_config(arch, vocab_size=64, initializer_range=0.1))
    assert await _max_diff(spec, True, torch.bfloat16, "cuda") == 0.0
