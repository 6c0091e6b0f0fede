"""Engine side of LoRA RL: keep the base weights, re-merge each synced adapter version.

Only adapters cross the wire (`miles.models.lora` names the payload). The torch engine
routes adapter-named tensors of a version into an `AdapterMerge` instead of its weight
stager; at commit the adapters are merged onto the kept base copy of each adapted layer
with `merge_weight` (the trainer's definition, so the engine's weights equal the
trainer's effective weights bit for bit), the full HF state is staged locally, and the
engine's atomic swap installs it, so no request sees a half-applied adapter.

The base copy is taken at the first adapter version from the engine's live weights,
which then still are the base (a LoRA run never pushes full weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from miles.core.errors import EngineError
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.models.lora import SCALE_NAME, merge_weight, scale_tensor

if TYPE_CHECKING:
    from miles.engines.base import Engine
    from miles.models.decoder import CausalLM


class _Params:
    """Duck-types what `hf_tensor_views` reads (spec + named_parameters) over a dict."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self._tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for k, v in self._tensors.items():
            yield k, nn.Parameter(v, requires_grad=False)


class AdapterMerge:
    """Staged adapter versions of one model, and the base weights they merge onto."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # parameter name -> base weight (adapted layers)
        self.version: int | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self.committed: dict[str, torch.Tensor] = {}  # the adapters the live weights hold

    @property
    def active(self) -> bool:
        """True once an adapter version was committed (the model holds base + adapters)."""
        return bool(self.committed)

    def stage(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Keep a copy of adapter tensors of `version` (the sender may reuse its buffers)."""
        if self.version is not None and version != self.version:
            raise EngineError(
                f"stage(version={version}): adapters of version {self.version} are still staged"
            )
        self.version = version
        for name, t in named:
            self._staged[name] = t.detach().to("cpu", copy=True)
        return len(self._staged)

    def merged_state(self, version: int) -> dict[str, torch.Tensor]:
        """HF name -> tensor of the whole model with the staged adapters merged on the base."""
        if self.version != version:
            raise EngineError(f"commit(version={version}): no adapters staged for it")
        items = self._staged
        if SCALE_NAME not in items or items[SCALE_NAME].numel() != 1:
            raise EngineError(f"adapters of version {version} lack a one-element {SCALE_NAME!r}")
        scale = float(items[SCALE_NAME])
        layers = sorted({k.rsplit(".", 1)[0] for k in items if k != SCALE_NAME})
        params = {n: p.detach() for n, p in self.model.named_parameters()}
        if self.committed and {f"{m}.weight" for m in layers} != set(self.base):
            raise EngineError(f"adapters of version {version} cover other layers than the last version")
        out = dict(params)
        for layer in layers:
            a, b = items.get(f"{layer}.lora_A"), items.get(f"{layer}.lora_B")
            w = f"{layer}.weight"
            if a is None or b is None or w not in params:
                raise EngineError(f"adapters of version {version}: bad adapter pair for {layer!r}")
            w0 = self.base.get(w)
            if w0 is None:  # first adapter version: the live weight still is the base
                w0 = self.base[w] = params[w].clone()
            if tuple(b.shape) != (w0.shape[0], a.shape[0]) or a.shape[1] != w0.shape[1]:
                raise EngineError(
                    f"adapters of version {version}: {layer!r} A {tuple(a.shape)} / B {tuple(b.shape)} "
                    f"do not fit its weight {tuple(w0.shape)}"
                )
            out[w] = merge_weight(w0, a.to(w0), b.to(w0), scale)
        return hf_tensor_views(_Params(self.model.spec, out))

    def committed_version(self) -> None:
        """The staged version went live."""
        self.committed, self._staged, self.version = self._staged, {}, None

    def drop(self) -> None:
        self._staged, self.version = {}, None

    def checksums(self) -> dict[str, str]:
        """Per-tensor checksums of the adapters the live weights hold (as received)."""
        return {k: tensor_checksum(v) for k, v in self.committed.items()}


class LoraMerger:
    """Apply one adapter version to a torch engine directly (no actor, no wire)."""

    def __init__(self, engine: Engine, scale: float) -> None:
        self.engine = engine
        self.scale = scale  # alpha / rank, as the trainer's config says

    async def apply(
        self,
        version: int,
        adapters: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    ) -> int:
        """Merge `adapters` ('<layer>.lora_A' / '.lora_B') onto the base and swap them in;
        returns the number of adapted layers."""
        items = dict(adapters.items() if isinstance(adapters, Mapping) else adapters)
        await self.engine.stage(version, [*items.items(), (SCALE_NAME, scale_tensor(self.scale))])
        await self.engine.commit(version)
        return len({k.rsplit(".", 1)[0] for k in items})
