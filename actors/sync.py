"""Weight-sync coordinator: trainer -> engines in fixed-size buckets, atomic commit per version.

Protocol per version v: pause (configured mode) -> stage every bucket on every engine
-> commit(v) everywhere -> resume -> optional checksum check. Every step has a
deadline. A live engine that fails or times out aborts v everywhere with a
`SyncError` naming the step and the peer; an engine the directory declares dead is
dropped from this sync, reported, and caught up when it comes back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.actors.messages import AbortVersion, Checksums, Commit, Pause, Resume, Stage
from miles.actors.runtime.host import Host
from miles.core.errors import ActorDeadError, MilesError, SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import tensor_checksum
from miles.transport.bulk.buckets import iter_buckets

log = get_logger("miles.sync")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SyncReport:
    version: int
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    committed: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    verified: bool | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSync:
    """Pushes one weight version to a set of engine actors over the zmq bulk path."""

    def __init__(self, host: Host, cfg: SyncConfig, engines: list[str]) -> None:
        if cfg.transport != "zmq":
            raise SyncError(
                f"sync.transport={cfg.transport!r} is not available in this build; valid: 'zmq'"
            )
        self.host = host
        self.cfg = cfg
        self.engines = list(engines)

    async def _all(self, step: str, names: list[str], make: Any, dead: list[str]) -> list[Any]:
        """Ask every live engine; a dead one is dropped, any other failure raises SyncError."""

        async def one(name: str) -> Any:
            try:
                return await self.host.ref(name).ask(make(), timeout=self.cfg.step_timeout_s)
            except ActorDeadError:
                dead.append(name)
                return None
            except MilesError as exc:
                raise SyncError(f"{step} failed on engine {name!r}: {type(exc).__name__}: {exc}") from exc

        return await asyncio.gather(*(one(n) for n in names))

    async def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        rep = SyncReport(version)
        live = [n for n in self.engines]
        t0 = time.perf_counter()
        dtype = _DTYPES.get(self.cfg.dtype)
        sums: dict[str, str] = {}
        verify = self.cfg.verify_every > 0 and version % self.cfg.verify_every == 0
        paused = False
        try:
            if self.cfg.pause_mode != "none":
                await self._all("pause", live, lambda: Pause(self.cfg.pause_mode), rep.dead)
                paused = True
            def converted() -> Iterable[tuple[str, torch.Tensor]]:
                for n, t in named:
                    t = t.to(dtype) if dtype is not None else t
                    if verify:  # whole tensors, before any chunking, as the engine holds them
                        sums[n] = tensor_checksum(t)
                    yield n, t

            for bucket in iter_buckets(converted(), self.cfg.bucket_mib << 20):
                live = [n for n in live if n not in rep.dead]
                await self._all(f"stage v{version} bucket {rep.buckets}", live,
                                lambda b=bucket: Stage(version, b.names, b.tensors), rep.dead)
                rep.bytes += bucket.nbytes
                rep.buckets += 1
            live = [n for n in live if n not in rep.dead]
            await self._all(f"commit v{version}", live, lambda: Commit(version), rep.dead)
            rep.committed = [n for n in live if n not in rep.dead]
        except SyncError:
            await self._abort(version, [n for n in live if n not in rep.dead])
            raise
        finally:
            if paused:
                try:
                    await self._all("resume", [n for n in live if n not in rep.dead],
                                    lambda: Resume(), rep.dead)
                except SyncError as exc:
                    log.error("resume_failed", error=str(exc))
        rep.seconds = time.perf_counter() - t0
        if verify:
            rep.verified = await self.verify(rep.committed, sums)
        if rep.dead:
            log.warning("sync_engines_dead", version=version, dead=rep.dead)
        return rep

    async def _abort(self, version: int, names: list[str]) -> None:
        dead: list[str] = []
        try:
            await self._all(f"abort v{version}", names, lambda: AbortVersion(version), dead)
        except SyncError as exc:
            log.error("abort_version_failed", version=version, error=str(exc))

    async def verify(self, engines: list[str], expected: dict[str, str]) -> bool:
        """Compare each engine's per-tensor xxh64 with the trainer's; raise SyncError on mismatch."""
        dead: list[str] = []
        got = await self._all("checksum", engines, lambda: Checksums(), dead)
        for name, sums in zip(engines, got, strict=True):
            if sums is None:
                continue
            bad = [k for k, v in expected.items() if sums.get(k) != v]
            if bad:
                raise SyncError(f"checksum mismatch on engine {name!r} for {len(bad)} tensor(s), e.g. {bad[:3]}")
        return True
