"""Config section for weight synchronization (trainer -> engines)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt
from miles.core.errors import ConfigError, EngineError

# also the type pick_compressor takes; *_sampled: compress only an entry whose sample shrinks enough
DeltaCompression = Literal["auto", "zlib", "lz4", "none", "zlib_sampled", "lz4_sampled"]
EnginePause = Literal["abort", "retract", "in_place"]  # what an engine's pause may be asked for
ENGINE_PAUSES: tuple[EnginePause, ...] = ("abort", "retract", "in_place")


def pause_mode_for(asked: str, engine_default: str) -> EnginePause:
    """The pause an engine makes when asked for `asked`: 'auto' = the engine's own (`engine_default`,
    what sync.pause_mode = 'auto' resolves to in a whole config; a SyncConfig built on its own, in
    tests and benches, sends 'auto' on the wire, and only the engine knows its type)."""
    mode = engine_default if asked == "auto" else asked
    for known in ENGINE_PAUSES:
        if mode == known:
            return known
    raise EngineError(f"pause mode {asked!r}: valid are auto, {', '.join(ENGINE_PAUSES)}")


@dataclass
class SyncConfig:
    transport: Literal["zmq", "ucx", "broadcast", "cuda_ipc", "disk_delta"] = opt(
        "zmq", "bulk channel the weight buckets travel on"
    )
    bucket_mib: int = opt(512, "fixed bucket size; a tensor larger than a bucket is split", "MiB")
    pipeline_depth: int = opt(
        2, "buckets in flight at once: bucket i+1 is packed and sent while bucket i is still being "
        "received and staged; each sender holds this many staging buffers", "buckets"
    )
    step_timeout_s: float = opt(120.0, "deadline of each sync step (stage, commit) per engine", "s")
    catchup_poll_s: float = opt(
        1.0, "how often trainer rank 0 asks every engine for its weight version, to catch up one that "
        "serves an older one (restarted)", "s")
    health_timeout_s: float = opt(
        5.0, "deadline of that version ask; an engine that misses it (dead, restarting) is asked again "
        "at the next poll", "s")
    pause_mode: Literal["auto", "abort", "retract", "in_place", "none"] = opt(
        "auto", "the one option for how engines pause around a commit: abort (drop running requests), retract "
        "(return them with their partial output, resubmitted), in_place (hold them and their KV; torch engine "
        "only), none (rely on the atomic swap alone; torch engine only); auto = the engine type's own: in_place "
        "for torch, retract for sglang (a standalone SyncConfig sends auto and each engine applies its own)"
    )
    verify_every: int = opt(0, "compare engine checksums with the trainer's every N versions; 0 = never", "versions")
    dtype: Literal["engine", "float32", "bfloat16", "float16", "same"] = opt(
        "engine", "dtype the weights travel in; 'engine' = engine.dtype (the trainer casts once, into its "
        "export buffer, so an fp32 trainer sends a bf16 engine half the bytes); 'same' = the trainer's export dtype"
    )
    catchup_source: Literal["auto", "export_buffer", "host_copy"] = opt(
        "auto", "where a restarted engine is caught up from. export_buffer: the trainer's flat export "
        "buffer, which holds the last pushed version until the next export (no extra memory; the next "
        "export waits for a running catch-up). host_copy: a copy of the last pushed version in host memory "
        "(one model's bytes in sync.dtype, pinned for GPU trainers), made after the push in a worker "
        "thread on a side stream, overlapping the next rollout wait and train step (a tensor-by-tensor "
        "export copies as it streams). auto = export_buffer for flat exports, else host_copy"
    )
    flat_export: Literal["auto", "on", "off"] = opt(
        "auto", "gather the trainer's weights into one persistent buffer and move byte ranges (the plan "
        "goes once; no per-tensor work per version; one extra copy of the weights on rank 0); auto = on "
        "for every transport but disk_delta"
    )
    sharded: bool = opt(
        False, "every trainer rank sends its own FSDP slices straight to the engines "
        "(weightsync/shard_coordinator.py): no rank gathers the model (extra memory per rank: its shard + one "
        "bucket); zmq, ucx or broadcast; a restarted engine gets the whole version at the next push"
    )
    delta: bool = opt(
        False, "sharded only: send a bucket as (index, word) pairs of the changed words when that is smaller "
        "(below 50% changed for fp32, 33% for bf16); engines rebuild it from their live weights, checked"
    )
    receive_ahead_mib: int = opt(
        1024, "sharded ucx only: engine memory (a bucket per trainer rank, for up to this many MiB / bucket_mib "
        "ranks) into which the receive of each rank's next bucket is posted ahead, so every rank's bytes move "
        "into an engine at once instead of one rank's at a time in header order; 0 = off", "MiB"
    )
    advertise_addr: str = opt(
        "", "address engines reach trainer rank 0 at (broadcast store, ucx listener); '' = the actor host's"
    )
    delta_dir: str = opt(
        "", "shared directory of disk_delta versions (weight_v{N}/); required for disk_delta. Its speed on the CPU "
        "bench (64 MiB, 16 MiB buckets, half the tensors changed per update, 2 shared cores): 0.63-0.72x of "
        "writing and reading the whole model as files (40-44 ms an update where the raw channel takes 26-30 ms at "
        "page-cache speed; 0.53-0.64x before session 17), not 0.8x, and measured why: of its ~25 ms of byte "
        "work, the file I/O of the changed half is ~13 ms and the rest is passes the design needs (the sender's "
        "digest of every byte to find the unchanged tensors ~5, its copy of the changed bytes as the next base ~3, "
        "the engine's copy of unchanged tensors into its double-buffered staging ~4, the check digest ~1); the "
        "other ~17 ms are a version's fixed costs over the actor wire (a stage ask per bucket, answered in order; "
        "the bucket files, index and rename; the commit). Where file I/O is slow (writeback, a busy disk) writing "
        "half the bytes wins: 1.1-1.8x (bench/results/weight_sync_disk_delta_cpu_s17.txt, "
        "bench/disk_delta_phases.py)", "path"
    )
    delta_compression: DeltaCompression = opt(
        "auto", "compression of disk_delta XOR deltas: zlib, lz4 or none; *_sampled = compress only an entry "
        "a sample of which shrinks to at most half (dense float changes barely compress); auto = lz4_sampled "
        "if lz4 is installed, else zlib_sampled"
    )
    delta_keep: int = opt(2, "disk_delta versions kept on disk (older ones are deleted)", "versions")

    def wire_dtype(self) -> str | None:
        """The resolved dtype name weights travel in, or None to keep the export's own.

        `engine` is resolved by `MilesConfig` to engine.dtype; a SyncConfig built on its own
        (tests, benches) with `engine` keeps the export dtype."""
        return None if self.dtype in ("same", "engine") else self.dtype

    @property
    def catchup_from_buffer(self) -> bool:
        return self.catchup_source == "export_buffer" or (self.catchup_source == "auto" and self.flat)

    @property
    def flat(self) -> bool:
        """Whether the trainer exports its weights flat (weightsync/flat.py)."""
        return self.flat_export == "on" or (self.flat_export == "auto" and self.transport != "disk_delta")

    def __post_init__(self) -> None:
        if self.delta_compression == "auto":  # the roles run the launcher's interpreter: the same packages
            self.delta_compression = "lz4_sampled" if importlib.util.find_spec("lz4") else "zlib_sampled"
        if self.bucket_mib <= 0:
            raise ConfigError(f"sync.bucket_mib={self.bucket_mib} must be > 0")
        if self.receive_ahead_mib < 0:
            raise ConfigError(f"sync.receive_ahead_mib={self.receive_ahead_mib} must be >= 0")
        if self.pipeline_depth < 1:
            raise ConfigError(f"sync.pipeline_depth={self.pipeline_depth} must be >= 1")
        for name in ("step_timeout_s", "catchup_poll_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sync.{name}={getattr(self, name)} must be > 0")
        if self.verify_every < 0:
            raise ConfigError(f"sync.verify_every={self.verify_every} must be >= 0")
        if self.delta_keep < 1:
            raise ConfigError(f"sync.delta_keep={self.delta_keep} must be >= 1")
        if self.sharded and self.transport not in ("zmq", "ucx", "broadcast"):
            raise ConfigError(f"sync.sharded needs sync.transport = zmq, ucx or broadcast, got {self.transport!r}")
        if self.delta and not self.sharded:
            raise ConfigError("sync.delta needs sync.sharded = true (deltas ride the sharded path)")
        if self.catchup_source == "export_buffer" and not self.flat:
            raise ConfigError("sync.catchup_source='export_buffer' needs a flat export (sync.flat_export = "
                              "'on', or 'auto' with a transport other than disk_delta)")
        if self.transport == "disk_delta" and not self.delta_dir:
            raise ConfigError("sync.transport='disk_delta' needs sync.delta_dir (a directory shared with engines)")
