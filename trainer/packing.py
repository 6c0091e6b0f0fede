"""Packing samples into micro-batches by a token budget, without padding.

Sequences are concatenated into one stream per micro-batch; position ids restart at 0
for each sequence and `cu_seqlens` marks the boundaries, so attention stays within a
sequence. Only positions whose logits predict a response token are tracked (the
"response view"), which is what every loss term works on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from miles.core.errors import TrainerError
from miles.trainer.batch import TrainSample


@dataclass
class MicroBatch:
    """One packed forward pass. N = packed tokens, M = response tokens, S = sequences."""

    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64, restart per sequence
    cu_seqlens: torch.Tensor  # [S + 1] int32
    routed_experts: torch.Tensor | None  # [N, L, k] int64, or None (live routing)
    resp_pos: torch.Tensor  # [M] packed positions whose logits predict response tokens
    resp_targets: torch.Tensor  # [M] the response token ids
    resp_seq: torch.Tensor  # [M] sequence index (0..S-1) of each response token
    loss_mask: torch.Tensor  # [M] float 0/1
    sample_ids: list[int]  # index of each packed sequence in the caller's sample list
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # more [M] per-token values
    route_valid: torch.Tensor | None = None  # [N] bool: False where a route row was padded
    pixels: torch.Tensor | None = None  # VL: the packed sequences' images, in order [patches, patch_dim]
    image_grid: torch.Tensor | None = None  # VL: [images, 3] (t, h, w) patches per image
    images_per_seq: list[int] = field(default_factory=list)  # VL: images of each packed sequence
    # the one temperature every packed sequence's logprobs are taken under (their samples'
    # `logprob_temperature`: a micro-batch never mixes two, see `pack`)
    temperature: float = 1.0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            routed_experts=mv(self.routed_experts),
            resp_pos=self.resp_pos.to(device),
            resp_targets=self.resp_targets.to(device),
            resp_seq=self.resp_seq.to(device),
            loss_mask=self.loss_mask.to(device),
            sample_ids=list(self.sample_ids),
            fields={k: v.to(device) for k, v in self.fields.items()},
            route_valid=mv(self.route_valid),
            pixels=mv(self.pixels),
            image_grid=self.image_grid,  # stays on the host: the tower reads it there
            images_per_seq=list(self.images_per_seq),
            temperature=self.temperature,
        )

    def image_kwargs(self, seq: slice | None = None) -> dict[str, torch.Tensor]:
        """`pixel_values` / `image_grid_thw` for the model (models/qwen2_5_vl.py): of the whole
        micro-batch, or of the packed sequences `seq`; {} without images."""
        if self.pixels is None or self.image_grid is None:
            return {}
        counts = self.images_per_seq
        lo, hi = (0, len(counts)) if seq is None else (seq.start or 0, seq.stop)
        a, b = sum(counts[:lo]), sum(counts[:hi])
        if a == b:
            return {}
        grid = self.image_grid
        rows = grid.prod(dim=1).tolist()
        p0, p1 = sum(rows[:a]), sum(rows[:b])
        return {"pixel_values": self.pixels[p0:p1], "image_grid_thw": grid[a:b]}


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence lengths into bins of `budget` tokens.

    A sequence longer than the budget gets a bin of its own (a packed causal sequence
    cannot be split without context parallelism). Indices inside a bin are ascending.
    """
    if budget < 1:
        raise TrainerError(f"micro_batch_tokens must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max(budget - n, 0))
    return [sorted(b) for b in bins]


def pack(
    samples: Sequence[TrainSample],
    indices: Sequence[int],
    per_token: Mapping[str, Sequence[np.ndarray]] | None = None,
    replay: bool = False,
) -> MicroBatch:
    """Concatenate `samples[indices]` into one micro-batch.

    `per_token` maps a field name to one array per sample (all samples, indexed like
    `samples`) of response length; they land in `MicroBatch.fields` in the response view.
    With `replay`, every sample must carry routed experts; a [T - 1] record is extended by
    repeating its last row for the final token, whose output no logprob depends on.
    """
    if not indices:
        raise TrainerError("pack: no samples given")
    temps = {samples[i].logprob_temperature for i in indices}
    if len(temps) > 1:
        raise TrainerError(f"pack: samples of temperatures {sorted(temps)} in one micro-batch; the forward "
                           "takes logprobs under one (plan micro-batches per temperature)")
    ids, pos, cu = [], [], [0]
    rpos, rtgt, rseq, rmask = [], [], [], []
    routes: list[np.ndarray] = []
    valid: list[np.ndarray] = []
    pixels: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    per_seq: list[int] = []
    offset = 0
    for j, i in enumerate(indices):
        s = samples[i]
        p, r = s.prompt_ids.size, s.response_ids.size
        t = p + r
        ids.append(np.concatenate([s.prompt_ids, s.response_ids]))
        pos.append(np.arange(t, dtype=np.int64))
        rpos.append(np.arange(offset + p - 1, offset + t - 1, dtype=np.int64))
        rtgt.append(s.response_ids)
        rseq.append(np.full(r, j, dtype=np.int64))
        assert s.loss_mask is not None
        rmask.append(s.loss_mask)
        if replay:
            re_ = s.routed_experts
            if re_ is None:
                raise TrainerError(f"pack: sample {i} has no routed_experts but replay is on")
            ok = np.ones(t, dtype=bool)
            if re_.shape[0] == t - 1:
                re_ = np.concatenate([re_, re_[-1:]], axis=0)
                ok[-1] = False
            valid.append(ok)
            routes.append(re_.astype(np.int64))
        offset += t
        cu.append(offset)
        if s.pixels is not None and s.image_grid is not None:
            pixels.append(s.pixels)
            grids.append(s.image_grid)
        per_seq.append(0 if s.image_grid is None else int(s.image_grid.shape[0]))
    fields: dict[str, torch.Tensor] = {}
    for name, arrays in (per_token or {}).items():
        fields[name] = torch.from_numpy(
            np.concatenate([np.asarray(arrays[i], dtype=np.float32) for i in indices])
        )
    return MicroBatch(
        input_ids=torch.from_numpy(np.concatenate(ids)),
        position_ids=torch.from_numpy(np.concatenate(pos)),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        routed_experts=torch.from_numpy(np.concatenate(routes)) if replay else None,
        resp_pos=torch.from_numpy(np.concatenate(rpos)),
        resp_targets=torch.from_numpy(np.concatenate(rtgt)),
        resp_seq=torch.from_numpy(np.concatenate(rseq)),
        loss_mask=torch.from_numpy(np.concatenate(rmask).astype(np.float32)),
        sample_ids=list(indices),
        fields=fields,
        route_valid=torch.from_numpy(np.concatenate(valid)) if replay else None,
        pixels=torch.from_numpy(np.concatenate(pixels)) if pixels else None,
        image_grid=torch.from_numpy(np.concatenate(grids)) if grids else None,
        images_per_seq=per_seq if pixels else [],
        temperature=temps.pop(),
    )


def filler_micro_batch(field_names: Sequence[str] = ()) -> MicroBatch:
    """A one-token micro-batch with no response tokens.

    A rank with fewer micro-batches than its peers runs these so every rank makes the same
    sequence of FSDP collectives; it contributes nothing to the loss.
    """
    empty_f = torch.zeros(0, dtype=torch.float32)
    empty_l = torch.zeros(0, dtype=torch.int64)
    return MicroBatch(
        input_ids=torch.zeros(1, dtype=torch.int64),
        position_ids=torch.zeros(1, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        routed_experts=None,
        resp_pos=empty_l,
        resp_targets=empty_l,
        resp_seq=empty_l,
        loss_mask=empty_f,
        sample_ids=[],
        fields={n: empty_f for n in field_names},
    )
