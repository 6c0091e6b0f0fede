"""`CausalLM.compile_blocks`: the compiled block pieces (models/compiled_block.py) give the
eager block's logits and gradients, packed and plain, and a new pack length reuses the graphs."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_reduced_close, forward_sums

from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_compiled_blocks_equal_eager(arch: str) -> None:
    """Traced by dynamo with the eager backend (inductor's code generation takes ~20 s of CPU;
    the H200 bench measures it); the graphs and their wiring are what is checked here."""
    torch._dynamo.reset()
    model = build_model(ModelSpec.from_hf(tiny_config(arch, vocab_size=64, initializer_range=0.2)), seed=0)
    cases = [(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)),
              torch.tensor([0, n // 3, n], dtype=torch.int32)) for n in (20, 33)]
    ref = []
    for ids, cu in cases:
        model.zero_grad()
        out = model(ids, cu_seqlens=cu).logits
        out.float().logsumexp(-1).sum().backward()
        ref.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.compile_blocks(backend="eager")
    for i, ((ids, cu), (want, grads)) in enumerate(zip(cases, ref, strict=True)):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # the 2nd length reuses the graphs
            model.zero_grad()
            out = model(ids, cu_seqlens=cu).logits
            out.float().logsumexp(-1).sum().backward()
            k, depth = forward_sums(model.spec, ids.shape[1])
            assert_reduced_close(out, want, k=k, depth=depth)
            for n, p in model.named_parameters():
                if n in grads:
                    assert_reduced_close(p.grad, grads[n], k=k, depth=2 * depth, what=n)
    assert all(layer.ops is not None for layer in model.model.layers)
    for layer in model.model.layers:
        layer.ops = None


def test_trainer_compile_option_compiles_the_policy_blocks() -> None:
    from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
    from miles.core.schema.trainer import TrainerConfig
    from miles.trainer.fsdp import FSDPTrainer

    spec = ModelSpec.from_hf(tiny_config("qwen2", vocab_size=32))
    cfg = TrainerConfig()
    cfg.compile = "on"
    t = FSDPTrainer(cfg, spec, 0, 1, seed=0)
    try:
        assert all(layer.ops is not None for layer in t.policy.model.layers)
    finally:
        t.close()
    assert TrainerConfig().compile == "auto"

    def resolved(cuda: bool, moe: bool) -> str:
        return resolve_trainer(TrainerConfig(), RuntimeFacts(cuda=cuda), moe=moe).compile

    assert (resolved(False, False), resolved(True, False), resolved(True, True)) == ("off", "try", "off")
