"""The torch engine's inputs for a vision-language model (models/qwen2_5_vl.py).

Per request, once: the images' features (the vision tower over every image of the request)
and the M-RoPE positions of its prompt with the offset `delta` it decodes with
(models/mrope.py, the function the trainer calls too). Per prefill: the fed span's
embeddings with image slots filled and its [3, n, T] positions; per decode step: position
kv_len + delta on every axis. A request without images in a VL model has delta 0 and plain
embeddings. Limits: requests with images never share prompt KV (engines/prompt_share.py);
decode runs eagerly (no CUDA graphs: their positions are the KV slots) and the paged pool is
refused for VL models.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from miles.core.errors import EngineError
from miles.core.images import image_token_mismatches
from miles.engines.sequence import Sequence, VLState

if TYPE_CHECKING:
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.models.qwen2_5_vl import VLCausalLM


def is_vl(model: Any) -> bool:
    return getattr(model.spec, "vision", None) is not None


def check_request(req: GenerateRequest, model: Any) -> None:
    """A VL model's request: its image placeholders must line up with its images' grids (0
    mismatches); any other model refuses images. EngineError naming the request."""
    vision = getattr(model.spec, "vision", None)
    if vision is None:
        if req.images is not None:
            raise EngineError(f"request {req.request_id}: images given but {model.spec.model_type} "
                              "is not a vision-language model")
        return
    bad = image_token_mismatches(req.input_ids, req.images, vision.image_token_id, vision.spatial_merge_size)
    if bad:
        n = 0 if req.images is None else req.images.count
        raise EngineError(f"request {req.request_id}: {bad} image token(s) of id {vision.image_token_id} do "
                          f"not line up with the {n} image grid(s) (placeholders expanded differently?)")


@torch.no_grad()
def vl_state(model: VLCausalLM, seq: Sequence, device: torch.device) -> VLState:
    from miles.models.mrope import mrope_positions

    v = model.vision
    imgs = seq.req.images
    grid = None if imgs is None else torch.from_numpy(imgs.grid)
    feats = None
    if imgs is not None and imgs.count and grid is not None:  # grid: there whenever images are
        feats = model.image_features(torch.from_numpy(imgs.pixels).to(device), grid.to(device))
    pos, delta = mrope_positions(seq.tokens, grid if grid is not None else [], v.image_token_id,
                                 v.spatial_merge_size)
    return VLState(feats, pos, delta)


def prefill_inputs(model: VLCausalLM, seqs: Seq[Sequence], ids: torch.Tensor, new_lens: Seq[int]) -> dict[str, torch.Tensor]:
    """`inputs_embeds` [n, T, H] and `rope_position_ids` [3, n, T] for a prefill of `ids` (row i
    feeds seqs[i].tokens[kv_len: kv_len + new_lens[i]], padded to T)."""
    dev = ids.device
    image_id = model.vision.image_token_id
    embeds = model.model.embed_tokens(ids)
    n, t = ids.shape
    rope = torch.zeros(3, n, t, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s.vl is None:
            s.vl = vl_state(model, s, dev)
        lo, k = s.kv_len, new_lens[i]
        rope[:, i, :k] = s.vl.positions[:, lo: lo + k]
        if k < t:  # padding: any position (its keys go to the scratch slot)
            rope[:, i, k:] = rope[:, i, k - 1: k] + 1
        if s.vl.features is None:
            continue
        before = sum(1 for x in s.tokens[:lo] if x == image_id)
        slots = ids[i, :k] == image_id
        m = int(slots.sum())
        if m:
            row = embeds[i, :k]
            row[slots] = s.vl.features[before: before + m].to(embeds.dtype)
    return {"inputs_embeds": embeds, "rope_position_ids": rope.to(dev)}


def decode_positions(seqs: Seq[Sequence], lens: torch.Tensor) -> torch.Tensor:
    """[3, n, 1] positions of a decode step: kv_len + delta on every axis."""
    delta = torch.tensor([0 if s.vl is None else s.vl.delta for s in seqs], device=lens.device)
    return (lens + delta)[None, :, None].expand(3, -1, 1)


def choose_unbanned(model: Any, logits: torch.Tensor, params: list[SamplingParams],
                    gens: list[torch.Generator | None], rng: torch.Generator) -> tuple[list[int], list[float]]:
    """`choose_tokens` with the image placeholder id never chosen: a sampled placeholder would
    be one image token more than the images fill, in the engine's ids and the trainer's. Like
    top-k / top-p, it truncates the choice only: the reported logprob stays the one under the
    full softmax(logits / T) (engines/base.py), which is what the trainer computes."""
    from miles.engines.sampling import host_tokens, sample_tokens, to_device
    from miles.models.logprobs import token_logprobs

    banned = logits.index_fill(1, to_device([model.spec.vision.image_token_id], logits.device, torch.long),
                               float("-inf"))
    tokens, _ = sample_tokens(banned, params, gens, rng)
    temps = to_device([p.temperature for p in params], logits.device, torch.float32).unsqueeze(-1)
    lps = token_logprobs(logits, tokens, temps)  # the full softmax: the trainer's definition
    both = torch.stack((tokens.to(torch.float64), lps.to(torch.float64)))
    return host_tokens(both.tolist())
