"""AdamW whose moments live on disk, one file per parameter bucket, streamed through one buffer.

`StreamedAdamW.step()` walks the buckets in order: the bucket's file (exp_avg then
exp_avg_sq of each of its parameters, raw bytes) is read into a pinned host buffer, copied
to one device buffer, updated there with torch's own single-tensor AdamW kernel
(`torch.optim.adam.adam`, the code `torch.optim.AdamW(foreach=False)` runs, so results are
bit-identical), copied back and written out. Only one bucket's moments are on the device
at a time. A worker thread reads the next bucket and writes the previous one while the
current one updates (two host buffers, used alternately; the thread serialises its I/O,
so a buffer is never refilled before its write finished).

Step counters stay in memory (one CPU scalar per parameter, as in torch's AdamW). The
moments are not part of `state_dict()`; checkpoint the directory itself.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch.optim.adam import adam

from miles.core.errors import ConfigError, TrainerError
from miles.core.schema.trainer import TrainerConfig
from miles.trainer.optim import build_adamw


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter], path: Path) -> None:
        self.index = index
        self.params = params
        self.path = path
        self.numels = [_local(p).numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.total = sum(self.numels)  # elements of one moment
        self.nbytes = 2 * self.total * 4


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) with disk-resident fp32 moments."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        directory: str | Path,
        bucket_bytes: int,
        device: torch.device,
    ) -> None:
        if bucket_bytes < 8:
            raise ConfigError(
                f"optimizer stream bucket size must be >= 8 bytes, got {bucket_bytes}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(list(params), defaults)
        self.device = device
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.buckets: list[tuple[int, _Bucket]] = []  # (param group index, bucket)
        for gi, group in enumerate(self.param_groups):
            cur: list[torch.nn.Parameter] = []
            size = 0
            for p in group["params"]:
                if _local(p).dtype != torch.float32:
                    raise TrainerError(f"streamed AdamW keeps fp32 masters; got a {p.dtype} param")
                n = 2 * _local(p).numel() * 4
                if cur and size + n > bucket_bytes:
                    self._add(gi, cur)
                    cur, size = [], 0
                cur.append(p)
                size += n
            if cur:
                self._add(gi, cur)
        self.steps = {p: torch.tensor(0.0) for _, b in self.buckets for p in b.params}
        biggest = max((b.nbytes for _, b in self.buckets), default=0)
        pin = device.type == "cuda"
        self._host = [torch.zeros(biggest, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # on a CPU device the host buffer is updated in place
        self._dev = torch.empty(biggest, dtype=torch.uint8, device=device) if pin else None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="optim-stream")
        self._initialised = False
        self.bucket_bytes_max = biggest

    def _add(self, gi: int, params: list[torch.nn.Parameter]) -> None:
        i = len(self.buckets)
        self.buckets.append((gi, _Bucket(i, params, self.dir / f"moments_{i:05d}.bin")))

    # ------------------------------------------------------------------ I/O (worker thread)
    @staticmethod
    def _read(b: _Bucket, buf: torch.Tensor) -> None:
        mv = buf[: b.nbytes].numpy().data
        with open(b.path, "rb", buffering=0) as f:
            got = f.readinto(mv)
        if got != b.nbytes:
            raise TrainerError(f"{b.path}: read {got} of {b.nbytes} bytes of optimizer moments")

    @staticmethod
    def _write(b: _Bucket, buf: torch.Tensor) -> None:
        tmp = b.path.with_suffix(".tmp")
        with open(tmp, "wb", buffering=0) as f:
            f.write(buf[: b.nbytes].numpy().data)
        os.replace(tmp, b.path)

    def _init_files(self) -> None:
        zeros = torch.zeros(max((b.nbytes for _, b in self.buckets), default=0), dtype=torch.uint8)
        for _, b in self.buckets:
            self._write(b, zeros)
        self._initialised = True

    # ------------------------------------------------------------------ update
    def _views(
        self, b: _Bucket, buf: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f = buf[: b.nbytes].view(torch.float32)
        avg, sq = f[: b.total], f[b.total :]
        shapes = [_local(p).shape for p in b.params]
        m = [avg[o : o + n].view(s) for o, n, s in zip(b.offsets, b.numels, shapes, strict=True)]
        v = [sq[o : o + n].view(s) for o, n, s in zip(b.offsets, b.numels, shapes, strict=True)]
        return m, v

    def moments(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of `p` read from disk (for checks and checkpoints)."""
        for _, b in self.buckets:
            for i, q in enumerate(b.params):
                if q is p:
                    buf = torch.zeros(b.nbytes, dtype=torch.uint8)
                    if self._initialised:
                        self._read(b, buf)
                    m, v = self._views(b, buf)
                    return m[i].clone(), v[i].clone()
        raise TrainerError("moments(): parameter is not managed by this optimizer")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # takes no closure, so never returns its loss
        if closure is not None:
            raise TrainerError("StreamedAdamW.step does not take a closure")
        if not self.buckets:
            return
        if not self._initialised:
            self._init_files()
        pending: list[Future[None]] = []
        reads = {
            i: self._io.submit(self._read, self.buckets[i][1], self._host[i % 2])
            for i in range(min(2, len(self.buckets)))
        }
        for i, (gi, b) in enumerate(self.buckets):
            host = self._host[i % 2]
            reads.pop(i).result()
            work = host
            if self._dev is not None:
                work = self._dev
                work[: b.nbytes].copy_(host[: b.nbytes], non_blocking=True)
            self._update(self.param_groups[gi], b, work)
            if self._dev is not None:
                host[: b.nbytes].copy_(work[: b.nbytes], non_blocking=True)
                torch.cuda.synchronize(self.device)
            pending.append(self._io.submit(self._write, b, host))
            if i + 2 < len(self.buckets):  # same buffer: queued after the write above
                reads[i + 2] = self._io.submit(self._read, self.buckets[i + 2][1], host)
        for f in pending:
            f.result()

    def _update(self, group: dict, b: _Bucket, buf: torch.Tensor) -> None:
        m, v = self._views(b, buf)
        live = [i for i, p in enumerate(b.params) if p.grad is not None]
        if not live:
            return
        beta1, beta2 = group["betas"]
        adam(
            [_local(b.params[i]) for i in live],
            [_local(g) for i in live if (g := b.params[i].grad) is not None],  # every one of `live`
            [m[i] for i in live],
            [v[i] for i in live],
            [],
            [self.steps[b.params[i]] for i in live],
            foreach=False,
            capturable=False,
            differentiable=False,
            fused=False,
            has_complex=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def close(self) -> None:
        self._io.shutdown(wait=True)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TrainerConfig, device: torch.device, rank: int
) -> torch.optim.Optimizer:
    """The trainer's optimizer as `trainer.memory.optimizer` says: in-memory or streamed AdamW."""
    if cfg.memory.optimizer == "adamw":
        return build_adamw(params, cfg.optim, device)
    params = [p for p in params if p.requires_grad]
    root = cfg.memory.stream_dir or tempfile.mkdtemp(prefix="miles-moments-")
    o = cfg.optim
    return StreamedAdamW(
        params,
        lr=o.lr,
        betas=(o.betas[0], o.betas[1]),
        eps=o.eps,
        weight_decay=o.weight_decay,
        directory=Path(root) / f"rank{rank}",
        bucket_bytes=int(cfg.memory.stream_bucket_mb * 2**20),
        device=device,
    )
