"""`VLCausalLM`: a Qwen2.5-VL-style vision-language model (qwen2_5_vl, and the miles-defined
qwen2_5_vl_moe whose language side is Qwen3-MoE-style).

The language side is `CausalLM` unchanged except for its rotary tables (M-RoPE,
models/mrope.py); the vision tower (models/vision.py) turns an image's patches into one
feature row per image token, and those rows replace the embeddings of the `image_token_id`
placeholders in order. How many placeholders an image has is fixed by its grid
(`image_tokens`), computed once when the prompt is built (core/images.py) and carried with
the sample, so the engine and the trainer scatter the same features into the same slots.

Checkpoint names are the original Qwen layout (`model.*`, `visual.*`, `lm_head.weight`), which
transformers 5 also writes with `save_pretrained`.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM, CausalLMOutput
from miles.models.errors import ModelInputError
from miles.models.mrope import MRotary, mrope_positions
from miles.models.vision import VisionTower
from miles.models.vl_config import VisionSpec


def image_tokens(grid: torch.Tensor | list[list[int]], merge: int) -> list[int]:
    """LM placeholder tokens per image: t * h * w / merge^2 for each (t, h, w) patch grid."""
    rows = grid.tolist() if isinstance(grid, torch.Tensor) else grid
    return [int(t) * int(h) * int(w) // (merge * merge) for t, h, w in rows]


class VLCausalLM(CausalLM):
    def __init__(self, spec: ModelSpec) -> None:
        if spec.vision is None:
            raise ModelInputError(f"{spec.model_type} has no vision config: VLCausalLM needs one")
        super().__init__(spec)
        self.vision: VisionSpec = spec.vision
        self.model.rotary = MRotary(spec.rope_spec, spec.vision.mrope_section)
        self.visual = VisionTower(spec.vision)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> None:
        if std is None:  # the nested config keeps initializer_range in text_config (or at the top)
            text = self.spec.hf_config.get("text_config") or {}
            std = float(text.get("initializer_range", self.spec.hf_config.get("initializer_range", 0.02)))
        super().init_weights(seed, std)
        for m in self.visual.modules():  # the tower's norms (norm1, norm2, ln_q) start as identity scales
            w = getattr(m, "weight", None)
            if hasattr(m, "eps") and isinstance(w, torch.nn.Parameter):
                w.fill_(1.0)

    def image_features(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """[sum of image tokens, hidden] features of the images (`models/vision.py`)."""
        return self.visual(pixels, grid)

    def embed(self, input_ids: torch.Tensor, pixels: torch.Tensor | None, grid: torch.Tensor | None,
              features: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with every image placeholder replaced by its feature row; raises
        naming both counts when the placeholders and the images' tokens disagree."""
        h = self.model.embed_tokens(input_ids)
        if features is None and pixels is None:
            return h
        if features is None:
            assert grid is not None and pixels is not None
            features = self.image_features(pixels, grid.to(torch.long))
        slots = input_ids == self.vision.image_token_id
        n = int(slots.sum())
        if n != features.shape[0]:
            raise ModelInputError(f"{n} image placeholder tokens (id {self.vision.image_token_id}) in input_ids "
                                  f"but the images give {features.shape[0]} feature rows")
        return h.masked_scatter(slots.unsqueeze(-1), features.to(h.dtype))

    def rope_positions(self, input_ids: torch.Tensor, grid: torch.Tensor | None,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """[3, B, T] M-RoPE positions of B rows, or of the sequences of one packed row
        (`cu_seqlens`); images are assigned to rows / sequences in order, each taking as many
        as its placeholders cover (`mrope_positions` refuses a run that does not line up)."""
        merge, image_id = self.vision.spatial_merge_size, self.vision.image_token_id
        grid_rows = [] if grid is None else grid.tolist()
        per = image_tokens(grid_rows, merge)
        flat = input_ids.tolist()
        if cu_seqlens is None:
            seqs = flat
        else:
            cu = cu_seqlens.tolist()
            seqs = [flat[0][a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]
        parts, k = [], 0
        for seq in seqs:
            n_img, tokens = 0, seq.count(image_id)
            while tokens > 0 and k + n_img < len(per):
                tokens -= per[k + n_img]
                n_img += 1
            pos, _ = mrope_positions(seq, grid_rows[k: k + n_img], image_id, merge)
            parts.append(pos)
            k += n_img
        if k != len(grid_rows):
            raise ModelInputError(f"{len(grid_rows)} image grids given but the ids' placeholders cover {k}")
        out = torch.stack(parts, dim=1) if cu_seqlens is None else torch.cat(parts, dim=1).unsqueeze(1)
        return out.to(input_ids.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_features: torch.Tensor | None = None,
        **kw: Any,
    ) -> CausalLMOutput:
        """`CausalLM.forward` with images: `pixel_values` [patches, C*tp*p*p] and
        `image_grid_thw` [n, 3] (or their `image_features` [tokens, hidden], computed once
        and reused) fill the image placeholders of `input_ids`, in order. Without
        `rope_position_ids` ([3, B, T]) they are derived from the ids and grids, per row or per
        packed sequence (`cu_seqlens`); rows must start at position 0 (no KV cache: the engine
        passes its own, engines/vl_inputs.py). Without images, position_ids drive the rotary."""
        if pixel_values is not None and image_grid_thw is None:
            raise ModelInputError("pixel_values need image_grid_thw ([n, 3] patch grid per image)")
        has_images = pixel_values is not None or image_features is not None
        if has_images:
            kw["inputs_embeds"] = self.embed(input_ids, pixel_values, image_grid_thw, image_features)
        if has_images and kw.get("rope_position_ids") is None and kw.get("kv_cache") is None:
            cu = kw.get("cu_seqlens")
            kw["rope_position_ids"] = self.rope_positions(input_ids, image_grid_thw, cu)
        return super().forward(input_ids, position_ids, **kw)
