"""The shared FP8 quantizer: the paper's worked example, E4M3 rounding, block scales,
bit-exact Ŵ between engine and trainer (and across processes), straight-through grads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import xxhash

from miles.core.errors import ConfigError
from miles.core.schema.model import ModelConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.factory import model_from_config
from miles.models.fp8 import (
    E4M3,
    FP8,
    IntGrid,
    block_scales,
    dequantize_blockwise,
    fake_quantize,
    quantize_blockwise,
    round_e4m3,
)
from miles.models.fp8_gemm import cublas_weight_scales, outer_major, quantize_activations
from miles.models.fp8_layout import fp8_block, parse_quantization_config, with_fp8
from miles.models.fp8_linear import fake_quantized
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def test_the_papers_worked_example() -> None:
    # s = 0.25; code = round(W / s) = [[0, -1], [2, 4]] clamped to [-4, 3]; Ŵ = s * code
    w = torch.tensor([[0.1, -0.2], [0.45, 1.1]])
    codes, s = quantize_blockwise(w, (2, 2), torch.tensor([[0.25]]), IntGrid(-4, 3))
    assert torch.equal(codes, torch.tensor([[0.0, -1.0], [2.0, 3.0]]))
    assert torch.equal(dequantize_blockwise(codes, s, (2, 2)), torch.tensor([[0.0, -0.25], [0.5, 0.75]]))


def _e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return v[torch.isfinite(v)].unique()


def test_e4m3_rounding_equals_torch_cast_ties_to_even_and_saturates() -> None:
    vals = _e4m3_values()
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties: half to even
    g = torch.Generator().manual_seed(0)
    x = torch.cat([vals, mids, torch.randn(50_000, generator=g) * 100, torch.randn(50_000, generator=g) * 1e-2,
                   torch.randn(20_000, generator=g) * 1e-3])
    x = x[x.abs() <= 448]
    assert torch.equal(round_e4m3(x), x.to(FP8).float())
    # beyond the range: saturated to ±448 (torch's plain cast gives NaN from 480 on)
    big = torch.tensor([448.5, 470.0, 1e6, -1e30, float("inf")])
    assert torch.equal(round_e4m3(big), torch.tensor([448.0, 448.0, 448.0, -448.0, 448.0]))
    assert torch.isnan(round_e4m3(torch.tensor([float("nan")]))).all()


def test_block_scales_partial_blocks_and_zero_blocks() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    w[256:, 128:] = 0.0  # one all-zero (partial) block
    codes, s = quantize_blockwise(w)
    assert codes.dtype == FP8 and codes.shape == w.shape and s.dtype == torch.float32 and s.shape == (3, 2)
    assert s[2, 1] == 1.0 and torch.all(codes[256:, 128:].float() == 0)
    amax = w[:128, :128].to(torch.bfloat16).float().abs().max()  # of the bf16-rounded weight
    assert s[0, 0] == amax / torch.tensor(448.0)  # amax / 448 in fp32
    assert codes.float().abs().max() == 448.0  # each block's amax maps to the top code
    w_hat = dequantize_blockwise(codes, s)
    err = (w_hat - w).abs()
    assert torch.all(err <= w.abs() * 2.0**-4 + 2.0**-10 * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200])
    assert torch.equal(fake_quantize(w), w_hat)
    # the given block size is used
    c2, s2 = quantize_blockwise(w, (64, 32))
    assert s2.shape == (5, 7) and torch.equal(block_scales(w, (64, 32)), s2)
    assert c2.dtype == FP8


_CHILD = """
import torch, xxhash
from miles.models.fp8 import quantize_blockwise
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(257, 300, generator=g) * torch.logspace(-6, 2, 300)).to(dtype)
    c, s = quantize_blockwise(w, (128, 128))
    print(xxhash.xxh64(c.view(torch.uint8).numpy().tobytes() + s.numpy().tobytes()).hexdigest())
"""


def test_codes_are_bit_identical_in_another_process() -> None:
    """The trainer process and the engine process quantize alike (fp32, bf16, fp16 weights)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    mine = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(3)
        w = (torch.randn(257, 300, generator=g) * torch.logspace(-6, 2, 300)).to(dtype)
        c, s = quantize_blockwise(w, (128, 128))
        mine.append(xxhash.xxh64(c.view(torch.uint8).numpy().tobytes() + s.numpy().tobytes()).hexdigest())
    assert out.stdout.split() == mine


def _spec(arch: str, block: tuple[int, int] = (32, 32)) -> ModelSpec:
    return with_fp8(ModelSpec.from_hf(tiny_config(arch, vocab_size=96, num_hidden_layers=2)), block)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3", "llama", "qwen2"])
def test_engine_and_trainer_compute_with_identical_weights(arch: str) -> None:
    """0 differing bytes between the engine's Ŵ and the trainer's over every quantized weight."""
    spec = _spec(arch)
    trainer = build_model(spec, seed=4)
    engine = TorchEngine(build_model(spec, seed=4))
    n = 0
    for mod_t, mod_e in zip(trainer.modules(), engine.model.modules(), strict=True):
        plan = getattr(mod_t, "fp8_plan", None)
        if plan is None:
            continue
        from miles.models.fp8_layout import dequantize_rows

        w_trainer = fake_quantized(mod_t.weight, plan)
        w_engine = dequantize_rows(mod_e.weight, mod_e.weight_scale_inv, plan, torch.float32)
        assert mod_e.weight.dtype == FP8
        assert torch.equal(w_trainer.view(torch.int32), w_engine.view(torch.int32))
        n += 1
    assert n == 4 * spec.num_layers - 2 * spec.num_moe_layers
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(trainer(ids).logits, engine.model(ids).logits)
    # the engine's HF view: DeepSeek-V3 names, codes and scales
    views = hf_tensor_views(engine.model)
    assert views["model.layers.0.self_attn.k_proj.weight"].dtype == FP8
    assert views["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (
        -(-spec.num_kv_heads * spec.head_dim // 32), -(-spec.hidden_size // 32))
    assert views["model.embed_tokens.weight"].dtype == torch.float32


def test_codes_do_not_depend_on_the_weight_dtype() -> None:
    """fp32 masters, their bf16 cast and an fp32 or bf16 sync copy give the same codes."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(9))
    c32, s32 = quantize_blockwise(w)
    c16, s16 = quantize_blockwise(w.to(torch.bfloat16))
    assert torch.equal(c32.view(torch.uint8), c16.view(torch.uint8)) and torch.equal(s32, s16)


def test_requantizing_the_dequantized_weights_gives_the_same_codes() -> None:
    """A loaded FP8 checkpoint is dequantized, then both sides quantize it again: that must give
    the file's codes and scales back (the amax is a bf16 value, zero codes are +0)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        w = torch.randn(384, 384, generator=g) * torch.logspace(-8, 4, 384)[torch.randperm(384, generator=g)][:, None]
        c, s = quantize_blockwise(w)
        c2, s2 = quantize_blockwise(dequantize_blockwise(c, s))
        assert torch.equal(c.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(s, s2)


def test_straight_through_gradient() -> None:
    spec = _spec("qwen3")
    m = build_model(spec, seed=2)
    lin = m.model.layers[0].mlp.down_proj
    plan = lin.fp8_plan
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(0))
    w = lin.weight.detach().clone().requires_grad_(True)
    y = F.linear(x, fake_quantized(w, plan))
    assert torch.equal(y, F.linear(x, fake_quantize(w.detach(), plan.block)))
    y.square().sum().backward()
    w2 = lin.weight.detach().clone().requires_grad_(True)
    F.linear(x, w2).square().sum().backward()  # d/dW depends on W only through y
    g_ref = (2 * y.detach()).t() @ x
    assert w.grad is not None and torch.allclose(w.grad, g_ref, rtol=1e-5, atol=1e-6)


def test_activation_quantization_per_token_block() -> None:
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize_activations(x)
    assert q.dtype == FP8 and s.shape == (7, 2)
    back = (q.float().view(7, 2, 128) * s.unsqueeze(-1)).view(7, 256)
    assert torch.allclose(back, x, rtol=2.0**-4, atol=1e-6)


def test_config_switch_and_quantization_config_checks() -> None:
    cfg = ModelConfig(arch="qwen3", vocab_size=64, fp8="blockwise", fp8_block=32)
    m = model_from_config(cfg)
    assert fp8_block(m.spec) == (32, 32)
    assert m.spec.hf_config["quantization_config"]["weight_block_size"] == [32, 32]
    assert fp8_block(model_from_config(ModelConfig(arch="qwen3", vocab_size=64)).spec) is None
    with pytest.raises(ConfigError, match="fp8_block"):
        ModelConfig(fp8="blockwise", fp8_block=0)
    for bad, msg in [({"quant_method": "awq"}, "quant_method"),
                     ({"quant_method": "fp8"}, "weight_block_size"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                      "activation_scheme")]:
        with pytest.raises(ConfigError, match=msg):
            parse_quantization_config(bad)
    assert parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 64]}) == (128, 64)


def test_int_grid_is_the_same_contract() -> None:
    # the E4M3 grid and the toy integer grid go through the same quantize/dequantize
    w = torch.tensor([[0.5, -0.25], [1.0, 2.0]])
    c, s = quantize_blockwise(w, (2, 2), torch.tensor([[2.0**-4]]), E4M3)
    assert torch.equal(dequantize_blockwise(c, s, (2, 2)), w)  # every value is on the grid: exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (quantizer CPU vs GPU bit-exactness)")
def test_codes_are_bit_identical_on_cuda() -> None:
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(1000, 777, generator=g) * torch.logspace(-8, 3, 777)).to(dtype)
        c, s = quantize_blockwise(w)
        cg, sg = quantize_blockwise(w.cuda())
        assert torch.equal(c.view(torch.uint8), cg.cpu().view(torch.uint8)) and torch.equal(s, sg.cpu())
        assert torch.equal(dequantize_blockwise(c, s, dtype=dtype), dequantize_blockwise(cg, sg, dtype=dtype).cpu())


@pytest.mark.parametrize("m", [1, 3, 256])
def test_scale_layouts_cublas_takes(m: int) -> None:
    # scaled_mm's 1x128 activation scales need strides (1, M); at M = 1 the usual
    # `.t().contiguous().t()` is a no-op (strides (K/128, 1)) and cuBLAS refused it on the H200
    xs = torch.rand(m, 4)
    assert xs.t().contiguous().t().stride() == ((1, m) if m > 1 else (4, 1))
    cm = outer_major(xs)
    assert cm.stride() == (1, m) and torch.equal(cm, xs)
    for kb in (3, 4, 8):  # 128x128 weight scales: [round_up(K/128, 4), N/128], strides (1, round_up(K/128, 4))
        ws = torch.rand(5, kb)
        w4 = cublas_weight_scales(ws)
        assert w4.shape == (-(-kb // 4) * 4, 5) and w4.stride() == (1, w4.shape[0])
        assert torch.equal(w4[:kb].t(), ws) and not w4[kb:].any()


def test_a_kernel_that_fails_or_computes_wrong_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.models import fp8_gemm
    from miles.models.fp8_layout import Fp8Plan, quantize_rows

    codes, scale = quantize_rows(torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.02,
                                 Fp8Plan((128, 128), (256,)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    monkeypatch.setattr(fp8_gemm, "broken", {})
    monkeypatch.setattr(fp8_gemm, "_validated", set())
    monkeypatch.setattr(fp8_gemm, "_pick", {})
    monkeypatch.setattr(fp8_gemm, "_has_triton", [True])

    def faulty(kind: str, x2: torch.Tensor, *_: torch.Tensor | None) -> torch.Tensor:
        """Injected kernels: one raises, one is 20% off (a layout bug, not FP8 rounding), one is right."""
        if kind == "triton_a8":
            raise RuntimeError("no kernel image for this device")
        y = F.linear(x2.float(), dequantize_blockwise(codes, scale))
        return (y * 1.2 if kind == "cublas_a8" else y).bfloat16()

    monkeypatch.setattr(fp8_gemm, "run", faulty)
    assert fp8_gemm.cuda_linear(x, codes, scale, None, act_fp8=True) is None  # both refused: dequantized path
    assert set(fp8_gemm.broken) == {"triton_a8", "cublas_a8"}
    assert "RuntimeError" in fp8_gemm.broken["triton_a8"] and "relative" in fp8_gemm.broken["cublas_a8"]
    y = fp8_gemm.cuda_linear(x, codes, scale, None, act_fp8=False)  # a correct kernel is checked once, kept
    assert y is not None and ("triton_a16", 256, 512) in fp8_gemm._validated and "triton_a16" not in fp8_gemm.broken


def _fp8_linear(n: int, k: int, rows: tuple[int, ...], seed: int = 0):  # type: ignore[no-untyped-def]
    from torch import nn

    from miles.models.fp8_layout import Fp8Plan, quantize_rows

    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    plan = Fp8Plan((128, 128), rows)
    codes, scale = quantize_rows(torch.randn(n, k, generator=g) * 0.02, plan)
    lin.fp8_plan = plan  # type: ignore[assignment]
    lin.weight = nn.Parameter(codes, requires_grad=False)
    lin.register_parameter("weight_scale_inv", nn.Parameter(scale, requires_grad=False))
    return lin.cuda(), plan


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (blockwise FP8 GEMMs, sm90)")
@pytest.mark.parametrize("kind", ["triton_a8", "cublas_a8", "triton_a16"])
def test_cuda_fp8_gemm_kernels_match_the_contract(kind: str) -> None:
    from miles.models.fp8_gemm import run

    lin, plan = _fp8_linear(3072, 1024, (2048, 512, 512))
    g = torch.Generator().manual_seed(1)
    # decode batch 1 is where cuBLAS's scale strides broke; the engine's decode buckets are powers of two,
    # the Triton kernels mask any M
    for m in (1, 8, 256) + ((7, 300) if kind.startswith("triton") else ()):
        x = torch.randn(m, 1024, generator=g).to("cuda", torch.bfloat16)
        y = run(kind, x, lin.weight, lin.weight_scale_inv, None)
        w_hat = dequantize_blockwise(lin.weight, lin.weight_scale_inv, (128, 128), torch.float32)
        if kind.endswith("a8"):  # x rounded per token and 128 columns exactly as quantize_activations does
            q, s = quantize_activations(x)
            x_ref = (q.float().view(m, 8, 128) * s.unsqueeze(-1)).view(m, 1024)
        else:  # activations exact; Ŵ rebuilt in bf16 in the kernel, as the trainer's forward casts it
            x_ref, w_hat = x.float(), w_hat.to(torch.bfloat16).float()
        ref = F.linear(x_ref, w_hat)
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-2, (kind, m)
    bias = torch.randn(3072, generator=g).to("cuda", torch.bfloat16)
    x = torch.randn(5, 1024, generator=g).to("cuda", torch.bfloat16)
    assert torch.allclose(run(kind, x, lin.weight, lin.weight_scale_inv, bias).float(),
                          run(kind, x, lin.weight, lin.weight_scale_inv, None).float() + bias.float(), atol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton activation quantizer)")
def test_cuda_triton_activation_codes_equal_torchs() -> None:
    pytest.importorskip("triton")
    from miles.models.fp8_triton import quantize_activations as triton_quant

    g = torch.Generator().manual_seed(6)
    for m in (1, 5, 256):
        x = (torch.randn(m, 1024, generator=g) * torch.logspace(-3, 2, 1024)).to("cuda", torch.bfloat16)
        x[0, :128] = 0  # an all-zero block: scale 1
        q, s = triton_quant(x)
        q0, s0 = quantize_activations(x)
        assert s.stride() == (1, m) and torch.equal(s, s0)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (blockwise FP8 GEMMs, sm90)")
def test_cuda_project_uses_an_fp8_kernel() -> None:
    from miles.models.fp8_gemm import broken
    from miles.models.fp8_layout import dequantize_rows
    from miles.models.fp8_linear import project

    lin, plan = _fp8_linear(3072, 1024, (2048, 512, 512))
    x = torch.randn(2, 3, 1024, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    for act_fp8 in (True, False):
        lin.fp8_gemm = act_fp8  # type: ignore[assignment]
        y = project(x, lin)
        assert not broken, broken  # every kernel tried ran and passed its first-result check
        ref = F.linear(x.float(), dequantize_rows(lin.weight, lin.weight_scale_inv, plan, torch.float32))
        assert y.shape == (2, 3, 3072) and float((y.float() - ref).norm() / ref.norm()) < (0.05 if act_fp8 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FP8 GEMMs inside decode CUDA graphs)")
async def test_cuda_engine_decodes_on_fp8_gemms() -> None:
    from miles.core.schema.engine import EngineConfig
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.models.fp8_gemm import broken
    from miles.models.logprobs import token_logprobs

    cfg = tiny_config("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    spec = with_fp8(ModelSpec.from_hf(cfg), (128, 128))
    engine = TorchEngine(build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0),
                         EngineConfig(device="cuda", max_batch_size=8))
    trainer = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0)
    try:
        prompt = list(range(1, 9))
        res = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=8)))
        assert not broken, broken
        ids = torch.tensor([prompt + res.output_ids[:-1]], device="cuda")
        logits = trainer(ids).logits[0, len(prompt) - 1:]
        lp = token_logprobs(logits.float(), torch.tensor(res.output_ids, device="cuda"), 1.0)
        # same weights; only the engine's FP8 activation rounding differs
        assert (lp.cpu() - torch.tensor(res.logprobs)).abs().max() < 0.1
    finally:
        await engine.close()


def test_the_fp8_quick_start_recipe_builds_an_fp8_model() -> None:
    from pathlib import Path

    from miles.core.config import check_documented, load_config
    from miles.core.schema import MilesConfig

    cfg = load_config(MilesConfig, Path(__file__).resolve().parents[2] / "examples" / "quickstart_fp8.toml")
    assert cfg.model.fp8 == "blockwise" and cfg.model.fp8_block == 32
    assert not check_documented(MilesConfig)
    m = model_from_config(cfg.model, vocab_size=64)
    assert fp8_block(m.spec) == (32, 32)
    engine = TorchEngine(m, cfg.engine)
    assert engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
