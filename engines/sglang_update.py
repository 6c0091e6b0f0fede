"""How a committed weight version reaches a SGLang server (engine.sglang_weight_update).

Both ways stage every bucket of a version on the miles side first and hand the whole version
to the server at commit, while generation is paused (sync.pause_mode), so no request sees a
mix of versions:

- `TensorUpdate` (in memory): buckets are copied into one flat buffer each, on the engine's
  device; commit posts them by reference to /update_weights_from_tensor. The payload is
  SGLang's own wire format for that endpoint: base64 of a `multiprocessing.reduction.
  ForkingPickler` dump of [(name, tensor), ...], one entry per tensor-parallel rank. A CUDA
  tensor travels as a CUDA IPC handle (the server maps the engine's buffer and copies from it;
  the engine and the server share the GPU); a host tensor as a shared-memory file name
  (torch's file_system sharing strategy). miles only writes this payload, which that endpoint
  requires; it never unpickles anything. The last committed version stays in its buffers, so
  a server restarted after a crash is brought back to it before it serves again.
- `DiskUpdate`: each bucket is a safetensors shard of a version folder; commit completes the
  folder (config, index) and posts /update_weights_from_disk. Reaches any server (another
  host, another GPU); a restarted server loads the last committed folder itself.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
from collections.abc import Awaitable, Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.core.errors import EngineError
from miles.models.hf_io import iter_checkpoint

Call = Callable[[str, str, dict[str, Any] | None], Awaitable[Any]]


class WeightUpdate(Protocol):
    """One way of moving a staged version into the server."""

    kind: str

    def begin(self, version: int) -> None:
        """A new version starts staging (leftovers of an earlier attempt are dropped)."""

    async def stage(self, version: int, bucket: dict[str, torch.Tensor]) -> None: ...

    async def commit(self, version: int, call: Call) -> None: ...

    def abort(self, version: int) -> None: ...

    def adopt(self, version: int) -> None:
        """Commit without the server (it is down): the restarted server is brought to this version."""

    async def replay(self, version: int, call: Call) -> None:
        """After a server restart: make it serve the last committed version again."""

    def committed(self) -> dict[str, torch.Tensor] | None:
        """The last committed version's tensors (HF names), None before the first commit."""


def _check(res: Any, version: int, path: str) -> None:
    if not isinstance(res, dict) or not res.get("success", False):
        msg = res.get("message") if isinstance(res, dict) else res
        raise EngineError(f"commit(version={version}): server refused {path}: {msg}")


class DiskUpdate:
    kind = "disk"

    def __init__(self, stage_root: Path, model_path: str, on_commit: Callable[[str, int], None]) -> None:
        self.stage_root, self.model_path, self.on_commit = stage_root, model_path, on_commit
        self.committed_dir: Path | None = None
        self._attempts = 0
        self._stale: list[Path] = []  # earlier committed folders, deleted once the server is up

    def _dir(self, version: int) -> Path:
        # one folder per staging attempt: a version pushed again (a catch-up after a restart) never
        # writes into the folder the server loads on its next restart
        return self.stage_root / f"v{version}.{self._attempts}"

    async def stage(self, version: int, bucket: dict[str, torch.Tensor]) -> None:
        d = self._dir(version)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"bucket-{len(list(d.glob('bucket-*.safetensors'))):05d}.safetensors"
        await asyncio.to_thread(save_file, {k: v.to("cpu") for k, v in bucket.items()}, str(path),
                                {"format": "pt"})

    def begin(self, version: int) -> None:
        self._attempts += 1
        shutil.rmtree(self._dir(version), ignore_errors=True)

    async def commit(self, version: int, call: Call) -> None:
        d = self._dir(version)
        await asyncio.to_thread(self._finish, d)
        await self._load(d, version, call)
        self.adopt(version)
        # the server is up and no longer reads them (a restart may still be loading a stale folder
        # while a commit is deferred: those wait for this point)
        for old in self._stale:
            shutil.rmtree(old, ignore_errors=True)
        self._stale = []

    async def _load(self, d: Path, version: int, call: Call) -> None:
        body = {"model_path": str(d), "weight_version": str(version), "flush_cache": True}
        _check(await call("POST", "/update_weights_from_disk", body), version, "/update_weights_from_disk")

    def adopt(self, version: int) -> None:
        d = self._dir(version)
        if not (d / "model.safetensors.index.json").is_file():
            self._finish(d)
        old, self.committed_dir = self.committed_dir, d
        self.on_commit(str(d), version)  # a restarted server loads this folder
        if old is not None and old != d:
            self._stale.append(old)

    def _finish(self, d: Path) -> None:
        for f in Path(self.model_path).iterdir():  # config, generation config, tokenizer: all but weights
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, d / f.name)
        weight_map: dict[str, str] = {}
        for shard in sorted(d.glob("bucket-*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), shard.name))  # noqa: SIM118
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    def abort(self, version: int) -> None:
        shutil.rmtree(self._dir(version), ignore_errors=True)

    async def replay(self, version: int, call: Call) -> None:
        if self.committed_dir is not None:  # a restart launched before the commit that moved the folder
            await self._load(self.committed_dir, version, call)

    def committed(self) -> dict[str, torch.Tensor] | None:
        return None if self.committed_dir is None else dict(iter_checkpoint(self.committed_dir))


def tensor_payload(named: list[tuple[str, torch.Tensor]], tp: int) -> list[str]:
    """/update_weights_from_tensor's `serialized_named_tensors`: one base64 ForkingPickler dump of
    the (name, tensor) list per tensor-parallel rank (each rank takes its own slices)."""
    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

    if any(t.device.type == "cpu" for _, t in named):
        # by file name: the default (file descriptors) needs a connection back to this process
        torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    one = base64.b64encode(buf.getvalue()).decode()
    return [one] * tp


class TensorUpdate:
    kind = "tensor"

    def __init__(self, device: str, tp: int) -> None:
        self.device, self.tp = torch.device(device), tp
        self._staged: dict[str, torch.Tensor] = {}
        self._committed: dict[str, torch.Tensor] | None = None

    def begin(self, version: int) -> None:
        self._staged = {}

    async def stage(self, version: int, bucket: dict[str, torch.Tensor]) -> None:
        # one flat buffer per bucket: the payload carries one shared storage per bucket, not one per tensor
        spans, off = [], 0
        for t in bucket.values():
            n = t.numel() * t.element_size()
            spans.append((off, n))
            off += -(-n // 64) * 64  # every tensor starts 64-byte aligned (a dtype view needs it)
        flat = torch.empty(off, dtype=torch.uint8, device=self.device)
        for (name, t), (lo, n) in zip(bucket.items(), spans, strict=True):
            view = flat[lo:lo + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            self._staged[name] = view
        if self.device.type == "cuda":
            await asyncio.to_thread(torch.cuda.synchronize, self.device)

    async def commit(self, version: int, call: Call) -> None:
        await self._send(self._staged, version, call)
        self.adopt(version)

    def adopt(self, version: int) -> None:
        self._committed, self._staged = self._staged, {}

    async def _send(self, tensors: dict[str, torch.Tensor], version: int, call: Call) -> None:
        payload = await asyncio.to_thread(tensor_payload, list(tensors.items()), self.tp)
        body = {"serialized_named_tensors": payload, "load_format": None, "flush_cache": True,
                "weight_version": str(version)}
        _check(await call("POST", "/update_weights_from_tensor", body), version, "/update_weights_from_tensor")

    def abort(self, version: int) -> None:
        self._staged = {}

    async def replay(self, version: int, call: Call) -> None:
        if self._committed is not None:
            await self._send(self._committed, version, call)

    def committed(self) -> dict[str, torch.Tensor] | None:
        return None if self._committed is None else {k: v.to("cpu") for k, v in self._committed.items()}
