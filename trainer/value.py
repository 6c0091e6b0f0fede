"""The PPO critic: a decoder backbone plus a scalar value head on its final hidden state.

The models' forward returns logits only, so the final normed hidden state is captured
with a forward hook on the backbone's last norm (see the report on `return_hidden`).
"""

from __future__ import annotations

import torch
from torch import nn

from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.trainer.packing import MicroBatch


class ValueModel(nn.Module):
    def __init__(self, spec: ModelSpec, seed: int = 0) -> None:
        super().__init__()
        self.lm = CausalLM(spec)
        self.lm.init_weights(seed)
        self.value_head = nn.Linear(spec.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self._hidden: list[torch.Tensor] = []
        self.lm.model.norm.register_forward_hook(self._grab)

    def _grab(self, _m: nn.Module, _i: object, out: torch.Tensor) -> None:
        self._hidden.append(out)

    def forward(self, mb: MicroBatch, routes: torch.Tensor | None = None) -> torch.Tensor:
        """Value of the state before each response token -> [M] fp32."""
        self._hidden = []
        self.lm(
            mb.input_ids.unsqueeze(0),
            mb.position_ids.unsqueeze(0),
            cu_seqlens=mb.cu_seqlens,
            routed_experts=routes,
        )
        h = self._hidden[-1][0, mb.resp_pos]
        self._hidden = []
        return self.value_head(h).squeeze(-1).float()
