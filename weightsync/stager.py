"""Staged weight updates: collect HF-named tensors bucket by bucket, then swap them in at once.

The staged copy lives beside the live weights, so the live model is never partially
updated; `apply` installs every staged tensor in one go and is called by the engine
between two forward passes. The staging area is allocated once and reused for every
version, so receiving a tensor is exactly one copy into it. How `apply` installs:

- bound to the model (`bind_model`): the staging area is a second set of parameter
  tensors; `apply` swaps each parameter's storage with its staged twin (no byte moves),
  and the next version stages into the previous live set. Packed parameters (one flat
  buffer and its twin) swap the two buffers' data pointers: one call, whatever the
  model's size. On a GPU the decode graphs are kept per storage address
  (engines/cuda_graph.py), so both sets keep valid graphs.
- otherwise (views only): one copy per tensor from the staging arena into the live views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from miles.core.errors import EngineError
from miles.core.logging import get_logger
from miles.models.fp8 import FP8
from miles.models.fp8_layout import quantize_hf_state
from miles.transport.bulk.base import dtype_of
from miles.weightsync.flat import FlatPlan
from miles.weightsync.param_buffer import pack_parameters

if TYPE_CHECKING:
    from miles.models.decoder import CausalLM

log = get_logger("miles.engine.weights")

# (parameter name, its full tensor) -> [(HF name, view into that tensor)]
ViewFn = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def _arena_views(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One contiguous buffer per device/dtype holding a same-shaped slot for every live view."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in live.items():
        groups.setdefault((t.device, t.dtype), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for (dev, dt), names in groups.items():
        buf = torch.empty(sum(live[n].numel() for n in names), dtype=dt, device=dev)
        pos = 0
        for n in names:
            k = live[n].numel()
            out[n] = buf[pos:pos + k].view(live[n].shape)
            pos += k
    return out


class WeightStager:
    def __init__(self, views: dict[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                 aside: Callable[[str], bool] | None = None) -> None:
        self._views = views  # HF name -> live parameter view
        # Tensors a flat plan may carry that are not the model's weights but that the engine takes
        # (`aside(name)`: a LoRA adapter payload): slots of their own, allocated from the plan
        # (`set_aside`), that flat ranges land in before the engine collects them.
        self._aside_ok = aside
        self._aside: dict[str, torch.Tensor] = {}
        self._aside_for = ""  # the digest of the plan `_aside` was allocated for
        # FP8 engine (models/fp8_linear.py): a float `X.weight` staged into an FP8 slot is quantized
        # here with the shared quantizer, its codes and `X.weight_scale_inv` staged together
        self.fp8_block = fp8_block
        self.version: int | None = None
        self._staged: set[str] = set()
        self._slots: dict[str, torch.Tensor] | None = None  # HF name -> staging destination
        self._params: list[tuple[str, torch.nn.Parameter]] | None = None  # set: commit swaps storages
        self._shadow: dict[str, torch.Tensor] = {}  # parameter name -> its staged twin
        # Packed parameters: the live and the staging flat buffers' storages (commit swaps
        # their data pointers: every parameter and slot view follows, at no per-tensor cost).
        self._pair: tuple[torch.UntypedStorage, torch.UntypedStorage] | None = None
        self._view_fn: ViewFn | None = None

    @property
    def instant_apply(self) -> bool:
        """True when `apply` is one pointer swap (cheap enough to run on the event loop)."""
        return self._pair is not None

    @property
    def swaps(self) -> bool:
        """True when commit swaps parameter storages instead of copying bytes."""
        return self._params is not None

    def bind_model(self, model: torch.nn.Module, view_fn: ViewFn) -> bool:
        """Commit by swapping `model`'s parameter storages, when that is safe; returns whether.

        `view_fn(param_name, tensor)` gives the HF views inside one parameter. Declined
        (copying stays) for weights off the CPU (captured CUDA graphs hold the old
        pointers) and when the HF views do not cover every byte of every parameter
        (a swap would then bring back stale bytes).
        """
        if self.version is not None:
            raise EngineError(f"bind_model: version {self.version} is staged; commit or abort it first")
        params = list(model.named_parameters())
        views: dict[str, torch.Tensor] = {}
        for pname, p in params:
            pv = view_fn(pname, p.data)
            if sum(v.numel() for _, v in pv) != p.numel():
                return False
            views.update(pv)
        if set(views) != set(self._views):
            return False
        self._params, self._view_fn = params, view_fn
        self._shadow, self._pair = self._pack_contiguous(params)
        self._views, self._slots = {}, None
        for pname, p in params:
            self._views.update(view_fn(pname, p.data))
        return True

    @staticmethod
    @torch.no_grad()
    def _pack_contiguous(params: list[tuple[str, torch.nn.Parameter]]) -> tuple[
            dict[str, torch.Tensor], tuple[torch.UntypedStorage, torch.UntypedStorage] | None]:
        """Move the live parameters into one flat buffer and give them a twin buffer, both in
        parameter order, so a bucket of consecutive tensors is one contiguous staging region
        a receiver can fill in a single write. Mixed dtypes keep separate allocations."""
        if len({p.dtype for _, p in params}) != 1:
            return {n: torch.empty_like(p.data) for n, p in params}, None
        live = pack_parameters([p for _, p in params])
        twin = torch.empty_like(live)
        shadow, pos = {}, 0
        for n, p in params:
            k = p.numel()
            shadow[n] = twin[pos:pos + k].view(p.shape)
            pos += k
        pair = (live.untyped_storage(), twin.untyped_storage())
        return shadow, pair if hasattr(pair[0], "_swap_data_ptr_") else None

    def live_views(self) -> dict[str, torch.Tensor]:
        """HF name -> live view (changes identity at every swapping commit)."""
        return self._views

    def _ensure_slots(self) -> dict[str, torch.Tensor]:
        if self._slots is None:
            if self._params is not None and self._view_fn is not None:
                if not self._shadow:
                    self._shadow = {n: torch.empty_like(p.data) for n, p in self._params}
                self._slots = {}
                for n, t in self._shadow.items():
                    self._slots.update(self._view_fn(n, t))
            else:
                self._slots = _arena_views(self._views)
        return self._slots

    def slot(self, name: str) -> torch.Tensor:
        """The staging destination of HF tensor `name` (a receiver may write into it directly)."""
        slots = self._ensure_slots()
        dst = slots.get(name)
        if dst is None:
            dst = self._aside.get(name)
        if dst is None:
            raise EngineError(f"unknown tensor {name!r}")
        return dst

    def set_aside(self, plan: FlatPlan) -> None:
        """Slots for the tensors of flat plan `plan` that the engine takes aside (see `aside`), once
        per plan: a plan of such tensors only gets one buffer laid out like the plan (each range
        lands in one copy); otherwise each gets its own. A name that is neither a weight nor taken
        aside gets no slot (the landing refuses the plan)."""
        if plan.digest == self._aside_for:
            return
        views, ok = self._views, self._aside_ok
        mine = [i for i, n in enumerate(plan.names) if n not in views and ok is not None and ok(n)]
        self._aside = {}
        dev = next(iter(views.values())).device if views else torch.device("cpu")
        whole = torch.empty(plan.nbytes, dtype=torch.uint8, device=dev) if len(mine) == len(plan.names) else None
        for i in mine:
            dt, shape = dtype_of(plan.dtypes[i]), plan.shapes[i]
            self._aside[plan.names[i]] = (whole[plan.offsets[i]:plan.ends[i]].view(dt).view(shape) if whole is not None
                                          else torch.empty(shape, dtype=dt, device=dev))
        self._aside_for = plan.digest

    def in_place(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> bool:
        """Whether every tensor already is its staging slot (staging them copies nothing)."""
        if not isinstance(named, list | tuple) or self._slots is None:
            return False
        slots = self._slots
        return all(n in slots and t.data_ptr() == slots[n].data_ptr() for n, t in named)

    def _begin(self, version: int) -> None:
        if self.version is not None and version < self.version:
            raise EngineError(f"stage(version={version}): a bucket of an older version than the staged "
                              f"{self.version} (a late bucket of an abandoned sync); refused")
        if self.version is not None and version > self.version:
            # Versions only grow and a coordinator never interleaves two: a newer version means the
            # staged one was abandoned (e.g. buckets that arrived after its abort). Drop it.
            log.warning("stale_staged_version_dropped", staged=self.version, new=version, tensors=len(self._staged))
            self.drop()
        self.version = version

    def staged_count(self, version: int) -> int:
        """How many tensors of `version` are staged (0: another version, or none)."""
        return len(self._staged) if self.version == version else 0

    def mark_staged(self, version: int, names: list[str]) -> int:
        """A receiver wrote `names` straight into their slots, checked once against a flat plan
        (weightsync/flat.py): bookkeeping only, no per-tensor work."""
        self._begin(version)
        self._staged.update(names)
        return len(self._staged)

    @torch.no_grad()
    def stage(
        self, version: int, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        self._begin(version)
        slots = self._ensure_slots()
        items = named.items() if isinstance(named, Mapping) else named
        if self.fp8_block is not None:
            items = self._fp8_items(items, slots)
        for name, t in items:
            dst = slots.get(name)
            if dst is None:
                raise EngineError(f"stage(version={version}): unknown tensor {name!r}")
            if tuple(t.shape) != tuple(dst.shape):
                raise EngineError(
                    f"stage(version={version}): tensor {name!r} has shape {tuple(t.shape)}, "
                    f"engine expects {tuple(dst.shape)}"
                )
            if t.data_ptr() != dst.data_ptr():  # a receiver that wrote into the slot is done already
                dst.copy_(t.detach())
            self._staged.add(name)
        return len(self._staged)

    def _fp8_items(self, items: Iterable[tuple[str, torch.Tensor]], slots: dict[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.fp8_block is not None
        for name, t in items:
            dst = slots.get(name)
            if dst is None or dst.dtype != FP8 or t.dtype == FP8:
                yield name, t
                continue
            if t.dtype == torch.uint8:  # codes as their raw bytes (fp8_linear.fp8_export)
                yield name, t.view(FP8)
                continue
            if tuple(t.shape) != tuple(dst.shape):
                raise EngineError(f"stage: tensor {name!r} has shape {tuple(t.shape)}, engine expects {tuple(dst.shape)}")
            yield from quantize_hf_state([(name, t)], self.fp8_block)

    def check_complete(self, version: int) -> None:
        if self.version != version:
            raise EngineError(f"commit(version={version}): nothing staged for it (staged: {self.version})")
        missing = sorted(set(self._views) - self._staged)
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise EngineError(
                f"commit(version={version}): {len(missing)} tensors not staged: {', '.join(missing[:3])}{more}"
            )

    @torch.no_grad()
    def apply(self) -> None:
        slots = self._ensure_slots()
        if self._pair is not None:
            # One pointer swap: parameters now read the staged bytes, slots write the old live ones.
            self._pair[0]._swap_data_ptr_(self._pair[1])  # type: ignore[attr-defined]  # private torch API, not in its stubs
        elif self._params is not None:
            for pname, p in self._params:
                p.data, self._shadow[pname] = self._shadow[pname], p.data
            self._views, self._slots = slots, self._views  # the old live set stages the next version
        else:
            for name in self._staged:
                self._views[name].copy_(slots[name])
        self.drop()

    def drop(self) -> None:
        self.version = None
        self._staged = set()


class Staging(Protocol):
    """The in-place weight landing an engine may offer (`Engine.staging()`): staging slots that
    bulk channels and flat byte ranges land in directly, and the bookkeeping of what landed.

    `model` is the live miles model the slots are bound to (its parameters are swapped at
    commit), or None for an engine without one (its live weights are `state_dict_hf()` copies).
    """

    @property
    def stager(self) -> WeightStager: ...  # read-only members: an engine's own narrower types fit

    @property
    def model(self) -> CausalLM | None: ...

    def mark_staged(self, version: int, names: list[str]) -> int:
        """Tensors `names` of `version` landed in their slots by byte range; returns how many
        tensors of `version` are staged so far."""
        ...
