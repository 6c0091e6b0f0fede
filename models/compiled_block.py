"""`torch.compile`d pieces of a decoder block (opt-in: `CausalLM.compile_blocks()`).

Eager, a block's elementwise work is one kernel per op over [tokens, hidden] (RMSNorm's cast,
statistics, scale; the residual adds; SiLU and the gate product over [tokens, 2 x inter]),
forward and backward: for a ~0.5B model at 16k-token packs, about as much time as its
GEMMs. Compiled, each group below is a few fused kernels. What is compiled is pure tensor
code with weights passed as tensors: no module, no packed-sequence object and no MoE routing
enters a graph, so FSDP2's hooks stay eager, one graph serves every layer (guards see only
shapes and dtypes; the token count is dynamic) and nothing recompiles per pack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _add_norm(norm: Norm, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + y
    return h, norm(h, w, eps)


def _swiglu_residual(h: torch.Tensor, x: torch.Tensor, w_gu: torch.Tensor, b_gu: torch.Tensor | None,
                     w_down: torch.Tensor, b_down: torch.Tensor | None) -> torch.Tensor:
    inter = w_down.shape[1]
    gu = F.linear(x, w_gu, b_gu)
    return h + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], w_down, b_down)


class CompiledOps:
    """The compiled pieces for one norm function (RMSNorm or the zero-centred one)."""

    def __init__(self, norm: Norm, backend: str) -> None:
        self.norm: Norm = torch.compile(norm, dynamic=True, backend=backend)
        self.add_norm = torch.compile(functools.partial(_add_norm, norm), dynamic=True, backend=backend)
        self.swiglu_residual = torch.compile(_swiglu_residual, dynamic=True, backend=backend)


@functools.cache
def compiled_ops(norm: Norm, backend: str = "inductor") -> CompiledOps:
    """One set per norm function and backend ("eager" traces without code generation: tests)."""
    return CompiledOps(norm, backend)
