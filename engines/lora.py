"""Engine side of LoRA RL: keep the base weights, re-merge each synced adapter version.

Only adapters cross the wire. `LoraMerger.apply(version, adapters)` merges them onto the
kept base copy with `miles.models.lora.merge_weight` (the trainer's definition, so the
engine's weights equal the trainer's effective weights bit for bit), then stages the
full HF state locally and commits it through the engine's atomic swap, so no request
sees a half-applied adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from miles.core.errors import EngineError
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views
from miles.models.lora import merge_weight


class _Params:
    """Duck-types what `hf_tensor_views` reads (spec + named_parameters) over a dict."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self._tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for k, v in self._tensors.items():
            yield k, nn.Parameter(v, requires_grad=False)


class LoraMerger:
    def __init__(self, engine: TorchEngine, scale: float) -> None:
        self.engine = engine
        self.scale = scale  # alpha / rank, as the trainer's config says
        self.base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    async def apply(
        self,
        version: int,
        adapters: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    ) -> int:
        """Merge `adapters` ('<layer>.lora_A' / '.lora_B') onto the base and swap them in;
        returns the number of adapted layers."""
        items = dict(adapters.items() if isinstance(adapters, Mapping) else adapters)
        layers = {k.rsplit(".", 1)[0] for k in items}
        merged = dict(self.base)
        for layer in sorted(layers):
            a, b = items.get(f"{layer}.lora_A"), items.get(f"{layer}.lora_B")
            w = f"{layer}.weight"
            if a is None or b is None or w not in self.base:
                raise EngineError(f"lora apply(version={version}): bad adapter pair for {layer!r}")
            w0 = self.base[w]
            merged[w] = merge_weight(w0, a.to(w0), b.to(w0), self.scale)
        views = hf_tensor_views(_Params(self.engine.spec, merged))  # type: ignore[arg-type]
        await self.engine.stage(version, views)
        await self.engine.commit(version)
        return len(layers)
