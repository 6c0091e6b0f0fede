"""trainer.optim.impl: the AdamW kernels agree to fp32 rounding; auto picks per device."""

from __future__ import annotations

import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
from miles.core.schema.trainer import OptimConfig, TrainerConfig
from miles.trainer.optim import adamw_kernel, build_adamw

pytestmark = pytest.mark.timeout(60)


def _run(impl: str, steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 32), (32,), (7, 3, 5))]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, impl=impl)  # type: ignore[arg-type]
    opt = build_adamw(params, cfg, torch.device("cpu"))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_kernels_agree_with_the_single_tensor_path(impl: str) -> None:
    ref = _run("single")
    got = _run(impl)
    moved = max((a - b).abs().max().item() for a, b in zip(ref, _run("single", steps=0), strict=True))
    assert moved > 1e-2  # the steps changed the weights, so agreement below means something
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_auto_is_fused_on_cuda_and_single_on_cpu() -> None:
    def resolved(cuda: bool) -> str:
        return resolve_trainer(TrainerConfig(), RuntimeFacts(cuda=cuda), moe=False).optim.impl

    assert adamw_kernel(resolved(True), torch.device("cuda", 0)) == {"foreach": False, "fused": True}  # type: ignore[arg-type]
    assert adamw_kernel(resolved(False), torch.device("cpu")) == {"foreach": False, "fused": False}  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not resolved"):  # auto never reaches the kernels
        adamw_kernel("auto", torch.device("cpu"))
    with pytest.raises(ConfigError, match="trainer.optim.impl"):  # the loader takes only the Literal's values
        load_config(MilesConfig, None, ["trainer.optim.impl=fast"])
