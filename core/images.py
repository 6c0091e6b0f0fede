"""Images of one sample or request, and the placeholder arithmetic engine and trainer share.

`ImageInput` holds every image of a sequence in order: `pixels` [patches, C*tp*p*p] float32
(one row per 3-D patch, the layout models/vision.py reads) and `grid` [n, 3] int64 (t, h, w
patches per image). On the wire both are numpy arrays, which the codec ships as out-of-band
zero-copy frames (transport/codec.py), never as Python lists.

Placeholder expansion happens once, where the prompt is built (`expand_placeholders`): each
image's single placeholder token becomes t*h*w / merge^2 copies. The expanded ids travel with
the sample; the engine and the trainer both check them against the grids with
`image_token_mismatches` (0 or the sample is refused), so both scatter the same features
into the same slots. numpy only: the rollout process does not import torch.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.core.errors import ProtocolError


@dataclass(frozen=True, eq=False)
class ImageInput:
    pixels: np.ndarray  # [patches, patch_dim] float32
    grid: np.ndarray  # [n, 3] int64: (t, h, w) patches per image, in order of appearance

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "images") -> None:
        p, g = self.pixels, self.grid
        if not isinstance(p, np.ndarray) or p.ndim != 2 or p.dtype != np.float32:
            desc = f"{p.dtype}{list(p.shape)}" if isinstance(p, np.ndarray) else type(p).__name__
            raise ProtocolError(f"{where}.pixels: expected a float32 [patches, patch_dim] array, got {desc}")
        if not isinstance(g, np.ndarray) or g.ndim != 2 or g.shape[1] != 3 or g.dtype.kind not in "iu":
            desc = f"{g.dtype}{list(g.shape)}" if isinstance(g, np.ndarray) else type(g).__name__
            raise ProtocolError(f"{where}.grid: expected an integer [n, 3] array (t, h, w), got {desc}")
        if g.size and int(g.min()) < 1:
            raise ProtocolError(f"{where}.grid: every t, h, w must be >= 1, got {g.tolist()}")
        if int(g.prod(axis=1).sum()) != p.shape[0]:
            raise ProtocolError(f"{where}: grids {g.tolist()} hold {int(g.prod(axis=1).sum())} patches, "
                                f"pixels have {p.shape[0]} rows")

    @property
    def count(self) -> int:
        return int(self.grid.shape[0])

    def tokens(self, merge: int) -> list[int]:
        """LM image tokens per image (t*h*w / merge^2)."""
        return image_token_counts(self.grid, merge)

    def digest(self) -> str:
        """Content hash (sha1 of grid and pixel bytes): equal images, equal digest."""
        h = hashlib.sha1(np.ascontiguousarray(self.grid, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.pixels).tobytes())
        return h.hexdigest()

    def to_wire(self) -> dict[str, Any]:
        return {"pixels": self.pixels, "grid": self.grid}

    @classmethod
    def from_wire(cls, d: Any, where: str = "images") -> ImageInput:
        if not isinstance(d, dict) or set(d) != {"pixels", "grid"}:
            raise ProtocolError(f"{where}: expected {{pixels, grid}} arrays, got {type(d).__name__} "
                                f"{sorted(d) if isinstance(d, dict) else ''}")
        p, g = d["pixels"], d["grid"]
        if not isinstance(p, np.ndarray) or not isinstance(g, np.ndarray):
            raise ProtocolError(f"{where}: pixels and grid must arrive as arrays (zero-copy frames), got "
                                f"{type(p).__name__} and {type(g).__name__}")
        return cls(pixels=p, grid=g.astype(np.int64, copy=False))

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form for prompts (the buffer dumps its prompts as JSON to resume): the
        pixels as base64 of their float32 bytes. Not for the wire: there the arrays travel as frames."""
        return {"grid": self.grid.tolist(), "shape": list(self.pixels.shape),
                "pixels_b64": base64.b64encode(np.ascontiguousarray(self.pixels).tobytes()).decode()}

    @classmethod
    def coerce(cls, v: Any, where: str = "image") -> ImageInput:
        """An ImageInput, or its `to_json` form."""
        if isinstance(v, ImageInput):
            return v
        if isinstance(v, dict) and set(v) == {"grid", "shape", "pixels_b64"}:
            try:
                raw = np.frombuffer(base64.b64decode(v["pixels_b64"]), dtype=np.float32)
                pixels = raw.reshape([int(x) for x in v["shape"]])
                grid = np.asarray(v["grid"], dtype=np.int64).reshape(-1, 3)
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"{where}: bad image {{grid, shape, pixels_b64}}: {exc}") from exc
            return cls(pixels, grid)
        raise ProtocolError(f"{where}: expected an ImageInput or its JSON form {{grid, shape, pixels_b64}}, "
                            f"got {type(v).__name__}")

    @classmethod
    def concat(cls, parts: Sequence[ImageInput]) -> ImageInput:
        """The images of several turns, in order (a session's second image after its first)."""
        return cls(np.concatenate([p.pixels for p in parts]), np.concatenate([p.grid for p in parts]))


def image_token_counts(grid: np.ndarray | Sequence[Sequence[int]], merge: int) -> list[int]:
    rows = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    return [int(t * h * w) // (merge * merge) for t, h, w in rows.tolist()]


def expand_placeholders(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
    """Each single `image_token_id` in `ids` becomes counts[k] copies (k-th image). Raises
    when the ids hold a different number of placeholders than there are images, or already
    hold runs (expanded twice)."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(counts):
        raise ProtocolError(f"{len(at)} image placeholder(s) (id {image_token_id}) in the prompt for "
                            f"{len(counts)} image(s)")
    out: list[int] = []
    prev = 0
    for i, n in zip(at, counts, strict=True):
        out.extend(ids[prev:i])
        out.extend([image_token_id] * n)
        prev = i + 1
    out.extend(ids[prev:])
    return out


def image_token_mismatches(ids: Sequence[int], images: ImageInput | None, image_token_id: int, merge: int) -> int:
    """Image tokens that do not line up with the images' grids (`placeholder_mismatches`)."""
    return placeholder_mismatches(ids, [] if images is None else images.tokens(merge), image_token_id)


def placeholder_mismatches(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> int:
    """|image tokens - sum of counts|, or, when the totals agree, the tokens of images that a
    run of placeholders cuts short. 0 when every image's placeholders stand together."""
    runs: list[int] = []
    n = 0
    for t in ids:
        if t == image_token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    bad = abs(sum(runs) - sum(counts))
    if bad == 0:  # same total: each run must end where an image ends (text never splits an image)
        k, left = 0, 0
        for r in runs:
            while r > 0 and k <= len(counts):
                if left == 0:
                    if k == len(counts):
                        break
                    left = counts[k]
                    k += 1
                take = min(r, left)
                r -= take
                left -= take
            bad += left
            left = 0
    return bad


def patchify(image: np.ndarray, patch: int, temporal: int, merge: int, mean: float = 0.5,
             std: float = 0.5) -> ImageInput:
    """One still image [H, W, C] (or [H, W]) with values in [0, 1] -> its patches in the
    tower's layout: normalised, repeated over `temporal` frames, one row per patch of
    C*temporal*patch^2 values (channel, frame, row, column), patches merge block by merge
    block. H and W must be multiples of patch * merge."""
    img = np.asarray(image, dtype=np.float32)
    if img.ndim == 2:
        img = img[..., None]
    if img.ndim != 3:
        raise ProtocolError(f"image: expected [H, W, C] or [H, W], got shape {list(img.shape)}")
    h, w, c = img.shape
    side = patch * merge
    if h % side or w % side:
        raise ProtocolError(f"image of {h}x{w}: height and width must be multiples of patch*merge={side}")
    gh, gw = h // patch, w // patch
    x = ((img - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    frames = np.broadcast_to(x[None], (temporal, c, h, w))
    x = frames.reshape(temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)  # block row, block col, row in block, col in block, C, t, y, x
    pixels = np.ascontiguousarray(x.reshape(gh * gw, c * temporal * patch * patch), dtype=np.float32)
    return ImageInput(pixels, np.array([[1, gh, gw]], dtype=np.int64))
