"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position axes (t, h, w).

A text token sits at (p, p, p); the tokens of one image (grid t x h x w after the patch
merger) at (s + ti, s + hi, s + wi) from the position s where the image starts, and the text
after it resumes at s + max(h, w). The rotary channel pairs are split by `mrope_section`
into three runs, each rotated by one axis. With all three axes equal this is plain RoPE, so a
text-only sequence gets exactly its 1-D tables.

`mrope_positions` is the one place these positions come from: the engine (prefill and the
per-sequence offset it decodes with) and the trainer both call it on the same token ids and
image grids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from miles.models.errors import ModelInputError
from miles.models.rope import RopeSpec


def mrope_positions(
    ids: Sequence[int] | torch.Tensor, grids: Sequence[Sequence[int]] | torch.Tensor, image_token_id: int,
    merge: int,
) -> tuple[torch.Tensor, int]:
    """(positions [3, T] int64, delta) for one sequence; `grids` holds each image's (t, h, w) in
    patches, in the order the images appear; an image's t * h * w / merge^2 tokens must stand as
    consecutive `image_token_id`s. delta = last position + 1 - T: the next token (decoding) sits
    at (T + delta) on all three axes."""
    toks = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    gl = grids.tolist() if isinstance(grids, torch.Tensor) else [list(g) for g in grids]
    n = len(toks)
    out = torch.empty(3, n, dtype=torch.long)
    cur, i, k = 0, 0, 0
    while i < n:
        if toks[i] != image_token_id:  # a run of text tokens
            j = i
            while j < n and toks[j] != image_token_id:
                j += 1
            out[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        if k >= len(gl):
            raise ModelInputError(f"image token at index {i} but only {len(gl)} image grid(s) were given")
        t, h, w = (int(x) for x in gl[k])
        lh, lw = h // merge, w // merge
        count = t * lh * lw
        if i + count > n or any(x != image_token_id for x in toks[i: i + count]):
            raise ModelInputError(f"image {k} (grid {t}x{h}x{w}, merge {merge}) needs {count} consecutive image "
                                  f"tokens from index {i}; the ids hold fewer")
        tt = torch.arange(t).view(t, 1, 1).expand(t, lh, lw).reshape(-1)
        hh = torch.arange(lh).view(1, lh, 1).expand(t, lh, lw).reshape(-1)
        ww = torch.arange(lw).view(1, 1, lw).expand(t, lh, lw).reshape(-1)
        out[:, i: i + count] = torch.stack((tt, hh, ww)) + cur
        cur += max(lh, lw)
        i += count
        k += 1
    if k != len(gl):
        raise ModelInputError(f"{len(gl)} image grid(s) given but the ids hold {k} image(s) of image tokens")
    last = int(out.max()) if n else -1
    return out, last + 1 - n


class MRotary(nn.Module):
    """`Rotary` (models/rope.py) over M-RoPE positions: forward takes [3, B, T] (or [B, T],
    the same position on every axis) and returns (cos, sin) [B, T, dim]. The frequencies stay
    fp32 whatever dtype the model is cast to, as in `Rotary`."""

    inv_freq: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, rope: RopeSpec, section: Sequence[int]) -> None:
        super().__init__()
        if rope.rope_type != "default" or rope.attention_factor != 1.0:
            raise ModelInputError(f"M-RoPE takes the default rope only, got rope_type={rope.rope_type!r}")
        self.rope = rope
        self.section = list(section)
        self.register_buffer("inv_freq", rope.inv_freq(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # recomputed, not cast back (see Rotary)
            self.inv_freq = self.rope.inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0).expand(3, *position_ids.shape)
        freqs = pos[..., None].float() * self.inv_freq.to(pos.device)  # [3, B, T, dim/2]
        parts = freqs.split(self.section, dim=-1)
        f = torch.cat([p[j % 3] for j, p in enumerate(parts)], dim=-1)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
