"""The batch hand-out to trainer ranks: each data-parallel rank receives only its shard, and
the shard's per-token arrays travel as a few zero-copy frames.

Sharding (`assign`): groups stay whole (group-normalised advantages are computed on one
rank); the largest group goes first to the least-loaded rank, ties to the lowest rank -
the rule `trainer.batch.shard_batch` applied to the whole batch, so a rank trains the
same samples as when every rank pulled the whole batch and kept its part.

Wire (`shard_to_wire`): one record per shard, columns instead of one dict per sample.
Token ids, loss masks, logprobs and versions of all the shard's samples are concatenated
into one array each (the dtypes the trainer computes in, so nothing is converted
there), with per-sample lengths; routed experts (R3) are concatenated along tokens
when every sample has them in one shape. The codec ships each array as an out-of-band
frame, and `shard_from_wire` returns per-sample views into those frames (no copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miles.core.errors import ProtocolError, TrainerError
from miles.rollout.types import Group, Sample

WIRE = "shard-1"


def assign(groups: list[Group], world: int) -> list[list[int]]:
    """Group indexes owned by each of `world` ranks, each rank's in batch order."""
    if world < 1:
        raise TrainerError(f"batch hand-out: world must be >= 1, got {world}")
    if len(groups) < world:
        raise TrainerError(f"batch hand-out: {len(groups)} groups cannot feed {world} ranks (each needs a group)")
    sizes = [sum(len(s.prompt_ids) + len(s.response_ids) for s in g.samples) for g in groups]
    load = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for gi in sorted(range(len(groups)), key=lambda g: (-sizes[g], g)):
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] += sizes[gi]
        owned[r].append(gi)
    return [sorted(o) for o in owned]


def _routed(samples: list[Sample]) -> tuple[np.ndarray | None, list[np.ndarray | None] | None, list[int]]:
    """(concatenated routed experts, or None; else the per-sample arrays; rows per sample)."""
    arrs = [s.routed_experts for s in samples]
    if all(a is None for a in arrs):
        return None, None, [0] * len(samples)
    rows = [-1 if a is None else int(a.shape[0]) for a in arrs]
    shapes = {(a.shape[1:], a.dtype.str) for a in arrs if a is not None}
    present = [a for a in arrs if a is not None]
    if len(shapes) == 1 and len(present) == len(arrs):
        return np.concatenate(present, axis=0), None, rows
    return None, arrs, rows


def shard_to_wire(groups: list[Group], indexes: list[int]) -> dict[str, Any]:
    """The groups `indexes` of the batch (their batch positions kept) as one columnar record."""
    samples = [s for gi in indexes for s in groups[gi].samples]
    group_of = [gi for gi in indexes for _ in groups[gi].samples]
    cat, per_sample, rows = _routed(samples)

    def col(field: str, dtype: Any) -> np.ndarray:
        parts = [np.asarray(getattr(s, field), dtype=dtype) for s in samples]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    return {
        "wire": WIRE,
        "group_of": np.asarray(group_of, dtype=np.int64),
        "reward": np.asarray([s.reward or 0.0 for s in samples], dtype=np.float64),
        "temperature": np.asarray([s.temperature for s in samples], dtype=np.float64),
        "prompt_len": np.asarray([len(s.prompt_ids) for s in samples], dtype=np.int64),
        "response_len": np.asarray([len(s.response_ids) for s in samples], dtype=np.int64),
        "prompt_ids": col("prompt_ids", np.int64),
        "response_ids": col("response_ids", np.int64),
        "loss_mask": col("loss_mask", np.float32),
        "rollout_logprobs": col("rollout_logprobs", np.float32),
        "versions": col("versions", np.int64),
        "routed_rows": np.asarray(rows, dtype=np.int64),
        "routed": cat,
        "routed_each": per_sample,
        "images": [None if s.images is None else s.images.to_wire() for s in samples],
    }


def _splits(lengths: np.ndarray, total: int, what: str) -> list[int]:
    if int(lengths.sum()) != total or (lengths < 0).any():
        raise ProtocolError(f"batch shard: {what} lengths sum to {int(lengths.sum())}, the array holds {total}")
    return np.cumsum(lengths)[:-1].tolist()


def shard_from_wire(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-sample dicts (views into the shard's frames): prompt_ids, response_ids, reward,
    group (batch position), temperature, loss_mask, rollout_logprobs, versions, routed_experts, images."""
    if not isinstance(d, dict) or d.get("wire") != WIRE:
        raise ProtocolError(f"batch shard: expected a {WIRE!r} record, got {str(d)[:80]}")
    n = int(d["group_of"].shape[0])
    p_len, r_len = d["prompt_len"], d["response_len"]
    prompts = np.split(d["prompt_ids"], _splits(p_len, d["prompt_ids"].size, "prompt"))
    per_tok = {k: np.split(d[k], _splits(r_len, d[k].size, k))
               for k in ("response_ids", "loss_mask", "rollout_logprobs", "versions")}
    rows = d["routed_rows"]
    if d["routed"] is not None:
        routed: list[Any] = np.split(d["routed"], _splits(rows, d["routed"].shape[0], "routed experts"))
    elif d["routed_each"] is not None:
        routed = list(d["routed_each"])
    else:
        routed = [None] * n
    if not (len(prompts) == len(routed) == len(d["images"]) == n) or n == 0:
        raise ProtocolError(f"batch shard: {n} samples, but {len(prompts)} prompts, {len(routed)} routed, "
                            f"{len(d['images'])} images")
    return [{"prompt_ids": prompts[i], "reward": float(d["reward"][i]), "group": int(d["group_of"][i]),
             "temperature": float(d["temperature"][i]),
             **{k: v[i] for k, v in per_tok.items()}, "routed_experts": routed[i], "images": d["images"][i]}
            for i in range(n)]


class Handout:
    """The batch of the current step, cut into the shard each rank asks for (one collection per
    step however many ranks ask; a rank's shard is encoded for it alone)."""

    def __init__(self) -> None:
        self.step = -1
        self.groups: list[Group] = []
        self.metrics: dict[str, float] = {}
        self._owned: dict[int, list[list[int]]] = {}  # world -> group indexes per rank

    def set(self, step: int, groups: list[Group], metrics: dict[str, float]) -> None:
        self.step, self.groups, self.metrics, self._owned = step, groups, metrics, {}

    def shard(self, rank: int, world: int) -> dict[str, Any]:
        if not 0 <= rank < world:
            raise TrainerError(f"batch hand-out: rank {rank} is not in a world of {world}")
        if world not in self._owned:
            self._owned[world] = assign(self.groups, world)
        return {"shard": shard_to_wire(self.groups, self._owned[world][rank]), "metrics": self.metrics}
