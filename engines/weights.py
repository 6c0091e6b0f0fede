"""Staged weight updates: collect HF-named tensors bucket by bucket, then swap them in at once.

The staged copy lives beside the live weights, so the live model is never partially
updated; `apply` copies every staged tensor in one go and is called by the engine
between two forward passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from miles.core.errors import EngineError


class WeightStager:
    def __init__(self, views: dict[str, torch.Tensor]) -> None:
        self._views = views  # HF name -> live parameter view
        self.version: int | None = None
        self._staged: dict[str, torch.Tensor] = {}

    def stage(
        self, version: int, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        if self.version is not None and version != self.version:
            raise EngineError(
                f"stage(version={version}): version {self.version} is still staged; commit or abort it first"
            )
        items = named.items() if isinstance(named, Mapping) else named
        batch: dict[str, torch.Tensor] = {}
        for name, t in items:
            dst = self._views.get(name)
            if dst is None:
                raise EngineError(f"stage(version={version}): unknown tensor {name!r}")
            if tuple(t.shape) != tuple(dst.shape):
                raise EngineError(
                    f"stage(version={version}): tensor {name!r} has shape {tuple(t.shape)}, "
                    f"engine expects {tuple(dst.shape)}"
                )
            batch[name] = t.detach().to(device=dst.device, dtype=dst.dtype, copy=True)
        self.version = version
        self._staged.update(batch)
        return len(self._staged)

    def check_complete(self, version: int) -> None:
        if self.version != version:
            raise EngineError(f"commit(version={version}): nothing staged for it (staged: {self.version})")
        missing = sorted(set(self._views) - set(self._staged))
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise EngineError(
                f"commit(version={version}): {len(missing)} tensors not staged: {', '.join(missing[:3])}{more}"
            )

    @torch.no_grad()
    def apply(self) -> None:
        for name, t in self._staged.items():
            self._views[name].copy_(t)
        self.drop()

    def drop(self) -> None:
        self.version = None
        self._staged = {}
