"""The torch engine's weight landing: staging a version's tensors aside, then committing them.

Full weights go to a `WeightStager` bound to the live model's HF views; a LoRA version's
adapter tensors go to an `AdapterMerge` (engines/lora.py) and are merged onto the base at
commit. A version carries one kind or the other, never both. An FP8 model (its spec names a
block size) holds E4M3 codes and block scales in its linear layers from construction on, and
the stager quantizes a float tensor staged into such a slot.

Plain class, composed by `TorchEngine`; it is also the engine's `Staging` (weightsync/stager.py):
bulk channels and flat byte ranges land in `stager`'s slots directly. The engine decides when
`apply` runs (under its step lock, between two forward passes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

import torch

from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.lora import AdapterMerge
from miles.models.decoder import CausalLM
from miles.models.fp8_layout import fp8_block
from miles.models.fp8_linear import weights_changed
from miles.models.fp8_model import to_fp8_weights
from miles.models.hf_io import checksums, hf_tensor_views
from miles.models.lora import is_adapter_name
from miles.weightsync.stager import WeightStager

Named = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class TorchWeights:
    """Staged versions of one live model's weights (full tensors or LoRA adapters) and their commit."""

    def __init__(self, model: CausalLM, cfg: EngineConfig) -> None:
        self.model = model
        self.fp8_block = fp8_block(model.spec)
        if self.fp8_block is not None:  # FP8 contract: linear layers hold E4M3 codes + block scales
            to_fp8_weights(model, self.fp8_block, gemm=cfg.fp8_gemm)
        # an adapter payload may come as a flat plan: its ranges land in slots set aside, then here
        self.stager = WeightStager(hf_tensor_views(model), self.fp8_block, aside=is_adapter_name)
        self.adapters = AdapterMerge(model)  # LoRA runs sync adapters only (engines/lora.py)

    async def stage(self, version: int, named_tensors: Named) -> int:
        # a receiver wrote into the slots: bookkeeping only (an empty bucket, e.g. part of a
        # chunked tensor, must not mark the version as a full-weights one: LoRA versions are not)
        if named_tensors and self.stager.in_place(named_tensors):
            return self.stager.stage(version, named_tensors)
        return await asyncio.to_thread(self._stage, version, named_tensors)

    def _stage(self, version: int, named: Named) -> int:
        """Worker thread: full weights go to the stager, an adapter payload (LoRA) aside."""
        items = named.items() if isinstance(named, Mapping) else named
        full: list[tuple[str, torch.Tensor]] = []
        lora: list[tuple[str, torch.Tensor]] = []
        for name, t in items:
            (lora if is_adapter_name(name) else full).append((name, t))
        if not full and not lora:  # e.g. a bucket holding only part of a chunked tensor
            return 0
        if lora and self.fp8_block is not None:
            raise EngineError(f"stage(version={version}): LoRA adapters cannot be merged into FP8 weights")
        mixed = (self.stager.version == version or bool(full)) if lora else self.adapters.version == version
        if mixed:
            raise EngineError(f"stage(version={version}): a version carries full weights or adapters, not both")
        return self.adapters.stage(version, lora) if lora else self.stager.stage(version, full)

    def mark_staged(self, version: int, names: list[str]) -> int:
        """Tensors a receiver wrote into their slots (a flat export's range): full weights are
        staged where they landed; adapters are copied from the slots set aside (the next
        version lands there) to the adapter merge, as an adapter bucket would be."""
        if not names:  # a range completing no tensor (part of a larger one) says nothing of the version's kind
            return self.adapters.stage(version, []) if self.adapters.version == version else \
                self.stager.staged_count(version)
        if any(is_adapter_name(n) for n in names):
            return self._stage(version, [(n, self.stager.slot(n)) for n in names])
        if self.adapters.version == version:
            raise EngineError(f"stage(version={version}): a version carries full weights or adapters, not both")
        return self.stager.mark_staged(version, names)

    async def ready(self, version: int) -> bool:
        """Before the commit: merge a LoRA version onto the base and stage the whole model
        locally, then check every tensor of `version` is staged. Whether it carried adapters."""
        with_adapters = self.adapters.version == version
        if with_adapters:
            merged = await asyncio.to_thread(self.adapters.merged_state, version)
            await asyncio.to_thread(self.stager.stage, version, merged)
        self.stager.check_complete(version)
        return with_adapters

    async def apply(self, with_adapters: bool) -> None:
        """Swap the staged version in; the caller holds the engine's step lock."""
        if self.stager.instant_apply:
            self.stager.apply()
        else:
            await asyncio.to_thread(self.stager.apply)
        weights_changed()  # tensors cached from the weights (CPU: FP8's Ŵ, q/k norms) are stale now
        if with_adapters:
            self.adapters.committed_version()

    def abort_version(self, version: int) -> None:
        if self.stager.version == version:
            self.stager.drop()
        if self.adapters.version == version:
            self.adapters.drop()

    def checksums(self) -> dict[str, str]:
        """Every live weight, plus (LoRA runs) the adapters merged into them, as received."""
        return {**checksums(self.model), **self.adapters.checksums()}
