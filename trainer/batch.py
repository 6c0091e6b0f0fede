"""The trainer's own batch type: one `TrainSample` per trajectory, validated on construction.

The trainer may not import miles.rollout, so the actor shell converts rollout samples into
these. Arrays are numpy (they arrive from the wire that way); packing into torch tensors
happens in trainer/packing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from miles.core.errors import TrainerError

_ROUTE_DTYPES = (np.uint8, np.uint16, np.int16, np.int32, np.int64)


def _ids(value: object, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise TrainerError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TrainerError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise TrainerError(f"{what}: token ids must be >= 0, found {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


@dataclass
class TrainSample:
    """One trajectory as the trainer sees it.

    `loss_mask`, `rollout_logprobs` and `versions` are per response token. `routed_experts`
    holds the expert ids the engine chose, shape [T, L, k] or [T - 1, L, k] where
    T = len(prompt) + len(response) (the last sampled token is never fed back to the engine,
    so it has no routing), L = MoE layers, k = experts per token.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    reward: float
    group_index: int = 0
    loss_mask: np.ndarray | None = None
    rollout_logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    versions: np.ndarray | None = None
    # a VL sample's images, as the engine got them (core/images.py): pixels [patches, patch_dim]
    # float32 and grid [n, 3] (t, h, w); the ids hold their placeholders already expanded
    pixels: np.ndarray | None = None
    image_grid: np.ndarray | None = None
    # the temperature its response was sampled at (0 = greedy): its logprobs are taken under it
    temperature: float = 1.0
    where: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        w = self.where or "sample"
        self.prompt_ids = _ids(self.prompt_ids, f"{w}.prompt_ids")
        self.response_ids = _ids(self.response_ids, f"{w}.response_ids")
        if self.prompt_ids.size == 0:
            raise TrainerError(f"{w}: empty prompt (the first response token needs a context)")
        if self.response_ids.size == 0:
            raise TrainerError(f"{w}: empty response")
        r = self.response_ids.size
        if self.loss_mask is None:
            self.loss_mask = np.ones(r, dtype=np.float32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.float32)
        if self.loss_mask.shape != (r,):
            raise TrainerError(f"{w}.loss_mask: shape {self.loss_mask.shape}, expected ({r},)")
        if self.rollout_logprobs is not None:
            lp = np.asarray(self.rollout_logprobs, dtype=np.float32)
            if lp.shape != (r,):
                raise TrainerError(f"{w}.rollout_logprobs: shape {lp.shape}, expected ({r},)")
            if not np.all(np.isfinite(lp)) or np.any(lp > 1e-4):
                raise TrainerError(f"{w}.rollout_logprobs: must be finite and <= 0")
            self.rollout_logprobs = lp
        if self.versions is not None:
            v = np.asarray(self.versions, dtype=np.int64)
            if v.shape != (r,):
                raise TrainerError(f"{w}.versions: shape {v.shape}, expected ({r},)")
            self.versions = v
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t < float("inf"):
            raise TrainerError(f"{w}.temperature: expected a finite number >= 0, got {t!r}")
        self.temperature = float(t)
        if not np.isfinite(float(self.reward)):
            raise TrainerError(f"{w}.reward: must be finite, got {self.reward}")
        self.reward = float(self.reward)
        if self.routed_experts is not None:
            re_ = np.asarray(self.routed_experts)
            t = self.total_len
            if re_.ndim != 3 or re_.shape[0] not in (t, t - 1):
                raise TrainerError(
                    f"{w}.routed_experts: shape {re_.shape}, expected [{t} or {t - 1}, layers, topk]"
                    f" for prompt {self.prompt_ids.size} + response {r} tokens"
                )
            if re_.dtype.type not in _ROUTE_DTYPES:
                raise TrainerError(f"{w}.routed_experts: integer dtype expected, got {re_.dtype}")
            self.routed_experts = re_
        if (self.pixels is None) != (self.image_grid is None):
            raise TrainerError(f"{w}: pixels and image_grid come together (a VL sample's images)")
        if self.pixels is not None and self.image_grid is not None:
            g = np.asarray(self.image_grid, dtype=np.int64)
            p = np.asarray(self.pixels, dtype=np.float32)
            if g.ndim != 2 or g.shape[1] != 3 or p.ndim != 2 or int(g.prod(axis=1).sum()) != p.shape[0]:
                raise TrainerError(f"{w}: image grid {list(g.shape)} and pixels {list(p.shape)} do not agree "
                                   "(grid [n, 3] whose t*h*w sum to the pixel rows)")
            self.pixels, self.image_grid = p, g

    @property
    def logprob_temperature(self) -> float:
        """The temperature its logprobs are taken under: greedy (0) counts as 1 (models/logprobs.py)."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def total_len(self) -> int:
        return int(self.prompt_ids.size + self.response_ids.size)

    @property
    def num_loss_tokens(self) -> int:
        assert self.loss_mask is not None
        return int((self.loss_mask > 0).sum())


@dataclass
class TrainBatch:
    """The samples one train step consumes (a rank's shard or the global batch)."""

    samples: list[TrainSample]
    weight_version: int = 0

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s.total_len for s in self.samples)


def validate_batch(
    batch: TrainBatch,
    *,
    needs_rollout_logprobs: bool,
    moe_layers: int = 0,
    topk: int = 0,
    num_experts: int = 0,
    replay: bool = False,
    allow_empty: bool = False,
) -> None:
    """Check a batch against what the step needs; raise TrainerError naming the sample."""
    if not batch.samples and not allow_empty:
        raise TrainerError("empty batch: a train step needs at least one sample")
    for i, s in enumerate(batch.samples):
        if needs_rollout_logprobs and s.rollout_logprobs is None:
            raise TrainerError(
                f"sample {i} (group {s.group_index}) has no rollout_logprobs, but the configured "
                "correction needs the engine's logprobs; record them in rollout or choose "
                "correction.old_logprobs='rollout' with no weight-based correction"
            )
        if replay and moe_layers > 0:
            if s.routed_experts is None:
                raise TrainerError(
                    f"sample {i} (group {s.group_index}) has no routed_experts but routing replay "
                    "(R3) is on for this MoE model; record routing in the engine or set "
                    "trainer.routing_replay=false"
                )
            _, layers, k = s.routed_experts.shape
            if (layers, k) != (moe_layers, topk):
                raise TrainerError(
                    f"sample {i}.routed_experts: per-token shape ({layers}, {k}) does not match "
                    f"the model's ({moe_layers} MoE layers, top-{topk})"
                )
            if num_experts and s.routed_experts.size and int(s.routed_experts.max()) >= num_experts:
                raise TrainerError(
                    f"sample {i}.routed_experts: expert id {int(s.routed_experts.max())} >= "
                    f"num_experts {num_experts}"
                )


def shard_batch(batch: TrainBatch, world: int) -> list[TrainBatch]:
    """Split a global batch across `world` DP ranks, keeping groups whole, balancing tokens.

    Groups stay on one rank so group-normalised advantages can be computed locally. Largest
    groups are placed first on the least-loaded rank (ties to the lowest rank): deterministic.
    """
    if world < 1:
        raise TrainerError(f"shard_batch: world must be >= 1, got {world}")
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(batch.samples):
        groups.setdefault(s.group_index, []).append(i)
    if len(groups) < world:
        raise TrainerError(
            f"shard_batch: {len(groups)} groups cannot feed {world} ranks (each rank needs a group)"
        )
    sizes = {g: sum(batch.samples[i].total_len for i in idx) for g, idx in groups.items()}
    order = sorted(groups, key=lambda g: (-sizes[g], g))
    load = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for g in order:
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] += sizes[g]
        owned[r].extend(groups[g])
    return [
        TrainBatch([batch.samples[i] for i in sorted(idx)], batch.weight_version) for idx in owned
    ]


def split_mini_batches(samples: Sequence[TrainSample], n: int) -> list[list[TrainSample]]:
    """Split samples into `n` runs of whole groups, in first-seen order (one optimizer step each)."""
    if n < 1:
        raise TrainerError(f"mini_batches must be >= 1, got {n}")
    if n == 1:
        return [list(samples)]
    by_group: dict[int, list[TrainSample]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s)
    groups = list(by_group.values())
    if len(groups) < n:
        raise TrainerError(f"{len(groups)} groups cannot be split into {n} mini-batches")
    out: list[list[TrainSample]] = []
    for j in range(n):
        lo, hi = j * len(groups) // n, (j + 1) * len(groups) // n
        out.append([s for g in groups[lo:hi] for s in g])
    return out


def image_token_counts(batch: TrainBatch, image_token_id: int, merge: int) -> tuple[int, int]:
    """(image tokens that do not line up with their sample's image grids, image tokens) over
    the batch (core/images.py `placeholder_mismatches`): what the engine fed and what the
    trainer will scatter features into must be the same slots, so the first is 0."""
    from miles.core.images import image_token_counts as per_image
    from miles.core.images import placeholder_mismatches

    bad = total = 0
    for s in batch.samples:
        ids = np.concatenate([s.prompt_ids, s.response_ids]).tolist()
        total += ids.count(image_token_id)
        counts = [] if s.image_grid is None else per_image(s.image_grid, merge)
        bad += placeholder_mismatches(ids, counts, image_token_id)
    return bad, total
