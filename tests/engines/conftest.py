"""Fixtures for engine tests: tiny random dense and MoE models with well-separated logits."""

from __future__ import annotations

import pytest

from miles.core.schema.engine import EngineConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.presets import tiny_config
from miles.models.registry import build_model

VOCAB = 97


def tiny_model(arch: str = "qwen3", seed: int = 0, **kw: object) -> CausalLM:
    cfg = tiny_config(arch, vocab_size=VOCAB, initializer_range=0.15, **kw)
    return build_model(ModelSpec.from_hf(cfg), seed=seed)


@pytest.fixture
def dense_model() -> CausalLM:
    return tiny_model("qwen3")


@pytest.fixture
def moe_model() -> CausalLM:
    return tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])


@pytest.fixture
async def engine(dense_model: CausalLM):
    eng = TorchEngine(dense_model, EngineConfig(max_batch_size=8, max_seq_len=256, kv_budget_tokens=1000))
    yield eng
    await eng.close()


@pytest.fixture
async def moe_engine(moe_model: CausalLM):
    eng = TorchEngine(moe_model, EngineConfig(max_batch_size=8, max_seq_len=256))
    yield eng
    await eng.close()
