"""Offload of the trainer's whole device state as ONE contiguous block to (pinned) host memory.

The first `offload()` packs every state tensor (parameters, optimizer moments, frozen
reference weights) into one flat device byte buffer and rebinds each tensor in place
(`Tensor.set_`) to a view of it. From then on an offload is one device->host copy of the
block followed by releasing the block's storage (`untyped_storage().resize_(0)`), and a
reload re-grows the same storage and copies the block back; every view keeps pointing at
that storage, so nothing needs rebinding again and the cost does not grow with the number
of tensors.

Tensors are grouped by the storage they live on and each storage is moved as a whole, so
aliases (FSDP2 keeps a padded flat shard and a narrowed DTensor local view of it) stay
aliases. After rebinding, an old storage still referenced elsewhere would silently keep
stale values; that is detected with the storage use count and refused.

Gradients are not copied: the trainer clears them (`zero_grad(set_to_none=True)`) at the
start of every mini-batch, so between steps their values are dead and offload just drops
them. On a CPU-only machine the "device" block and the host copy are two CPU buffers (not
pinned), which still frees the block's memory while offloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from miles.core.errors import TrainerError

_ALIGN = 256  # bytes; keeps every view aligned for any dtype and vector width


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that owns the memory (a DTensor's local shard)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _fsdp_tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Every tensor FSDP2 keeps per parameter (padded flat shard, its DTensor, all-gather
    outputs and unsharded parameter, which with one rank alias the shard)."""
    out: list[torch.Tensor] = []
    for root in modules:
        for m in root.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            if get_state is None:
                continue
            group = get_state()._fsdp_param_group
            if group is None:
                continue
            for fp in group.fsdp_params:
                for v in vars(fp).values():
                    items = v if isinstance(v, list | tuple) else [v]
                    out.extend(_local(x) for x in items if isinstance(x, torch.Tensor))
    return out


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def trainer_state_tensors(
    modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> list[torch.Tensor]:
    """Every tensor object that refers to the memory of these modules' parameters and
    buffers and the optimizers' state, DTensors unwrapped to their local shards.

    FSDP2's internal tensors are included only where they alias that memory: its own
    unsharded buffers (freed by FSDP with `resize_(0)` after each reshard) must never be
    rebound into the block.
    """
    mods = list(modules)
    out: list[torch.Tensor] = []
    for m in mods:
        out.extend(_local(p) for p in m.parameters())
        out.extend(_local(b) for b in m.buffers())
    for opt in optimizers:
        for st in opt.state.values():
            out.extend(_local(v) for v in st.values() if isinstance(v, torch.Tensor))
    owned = {_ptr(t) for t in out if t.untyped_storage().nbytes()}
    out.extend(t for t in _fsdp_tensors(mods) if _ptr(t) in owned)
    return out


class FlatOffload:
    """Moves the device tensors `collect()` names between one device block and one host block.

    The set is re-read at every offload; the block is re-packed only when some tensor is
    not yet a view of it (e.g. the optimizer created its moments at the first step), which
    is the one per-tensor copy.
    """

    def __init__(self, collect: Callable[[], list[torch.Tensor]], device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._collect = collect
        self._tensors: list[torch.Tensor] = []
        self._block: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self.nbytes = 0
        self.offloaded = False
        self.repacks = 0

    def _current(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for t in self._collect():
            # a view made with autograd tracking keeps its base alive, which references
            # the same memory: the base is rebound too
            cur: torch.Tensor | None = t
            while (
                cur is not None
                and cur.device == self.device
                and cur.untyped_storage().nbytes()  # holds no memory (e.g. a freed buffer)
                and id(cur) not in seen
            ):
                seen.add(id(cur))
                out.append(cur)
                cur = cur._base
        return out

    # ------------------------------------------------------------------ layout
    @torch.no_grad()
    def _build(self) -> None:
        """Copy every storage into one block and rebind its tensors as views of it."""
        by_storage: dict[int, list[torch.Tensor]] = {}
        storages: dict[int, torch.UntypedStorage] = {}
        for t in self._tensors:
            st = t.untyped_storage()
            key = st.data_ptr()
            by_storage.setdefault(key, []).append(t)
            storages[key] = st
        offsets: dict[int, int] = {}
        total = 0
        for key, st in storages.items():
            offsets[key] = total
            total += -(-st.nbytes() // _ALIGN) * _ALIGN
        block = torch.empty(total, dtype=torch.uint8, device=self.device)
        for key, st in storages.items():
            n = st.nbytes()
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st, 0, (n,), (1,))
            block[offsets[key] : offsets[key] + n].copy_(src)
            del src
        flat = block.untyped_storage()
        for key, ts in by_storage.items():
            for t in ts:
                size = t.element_size()
                if offsets[key] % size:
                    raise TrainerError(f"offload: misaligned slot for a {t.dtype} tensor")
                t.set_(flat, offsets[key] // size + t.storage_offset(), t.shape, t.stride())
        for key, st in storages.items():
            # our dict holds one reference; any other means a tensor we were not given
            # still uses the old memory and would diverge from the block
            uses = torch._C._storage_Use_Count(st._cdata)
            if uses > 1:
                shapes = [tuple(t.shape) for t in by_storage[key]]
                raise TrainerError(
                    f"offload: memory of state tensors {shapes} is also held by {uses - 1} "
                    "reference(s) outside the set given to FlatOffload; they would keep stale values"
                )
        self._block = block
        self.nbytes = total
        self.repacks += 1
        if self._host is None or self._host.numel() != total:
            pin = self.device.type == "cuda"
            self._host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)

    # ------------------------------------------------------------------ moves
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def offload(self, modules: Iterable[nn.Module] = ()) -> float:
        """Device block -> host block, then free the device block; drops the gradients
        of `modules`' parameters. Returns seconds spent."""
        if self.offloaded:
            raise TrainerError("offload() called twice without reload()")
        for m in modules:
            for p in m.parameters():
                p.grad = None
        current = self._current()
        block_ptr = _ptr(self._block) if self._block is not None else None
        if any(_ptr(t) != block_ptr for t in current):
            # new state (e.g. moments made at the first optimizer step): re-pack; the old
            # block's memory goes once its views are rebound into the new one
            self._tensors = current
            self._block = None
            self._build()
        assert self._block is not None and self._host is not None
        self._sync()
        t0 = time.perf_counter()
        self._host.copy_(self._block, non_blocking=True)
        self._sync()
        self._block.untyped_storage().resize_(0)
        self.offloaded = True
        return time.perf_counter() - t0

    @torch.no_grad()
    def reload(self) -> float:
        """Re-grow the device block and copy the host block back. Returns seconds spent."""
        if not self.offloaded:
            raise TrainerError("reload() called while the state is on the device")
        assert self._block is not None and self._host is not None
        t0 = time.perf_counter()
        self._block.untyped_storage().resize_(self.nbytes)
        self._block.copy_(self._host, non_blocking=True)
        self._sync()
        self.offloaded = False
        return time.perf_counter() - t0
