"""Synthetic HF-named bf16 weights of realistic decoder shapes, sized to a byte target.

Shapes follow Qwen2-style checkpoints (embed, q/k/v/o with biases, gated MLP, norms,
untied lm_head), so bucketing meets the same mix of small norms and tensors larger than a
bucket (embeddings) as a real sync. Values are exact small integers (a bf16-exact pattern
that differs per tensor and position), so the receiver can check every byte cheaply.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# name -> (hidden, intermediate, kv_heads * head_dim, vocab), one per size class
SHAPES = {
    "small": (896, 4864, 128, 151936),   # Qwen2.5-0.5B-like
    "medium": (1536, 8960, 256, 151936),  # Qwen2.5-1.5B-like
    "large": (4096, 12288, 1024, 151936),  # Qwen3-8B-like
    "tiny": (256, 512, 64, 4096),  # CPU smoke runs: the embedding still spans several 1 MiB buckets
}


def shape_class(target_bytes: int) -> str:
    if target_bytes <= 1 << 30:
        return "small"
    if target_bytes <= 4 << 30:
        return "medium"
    return "large"


def layout(target_bytes: int, klass: str = "") -> list[tuple[str, list[int]]]:
    """(HF name, shape) of a decoder whose bf16 bytes reach `target_bytes` (layers added until then).

    `klass` overrides the size class ("tiny" for CPU runs); the embedding and lm_head are
    always present, so the smallest result is their size.
    """
    h, inter, kv, vocab = SHAPES[klass or shape_class(target_bytes)]
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, h])]
    total = 2 * (2 * vocab * h + h)

    def layer(i: int) -> list[tuple[str, list[int]]]:
        p = f"model.layers.{i}."
        return [
            (p + "input_layernorm.weight", [h]),
            (p + "self_attn.q_proj.weight", [h, h]), (p + "self_attn.q_proj.bias", [h]),
            (p + "self_attn.k_proj.weight", [kv, h]), (p + "self_attn.k_proj.bias", [kv]),
            (p + "self_attn.v_proj.weight", [kv, h]), (p + "self_attn.v_proj.bias", [kv]),
            (p + "self_attn.o_proj.weight", [h, h]),
            (p + "post_attention_layernorm.weight", [h]),
            (p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
            (p + "mlp.down_proj.weight", [h, inter]),
        ]

    i = 0
    while total < target_bytes:
        lay = layer(i)
        out.extend(lay)
        total += 2 * sum(_numel(s) for _, s in lay)
        i += 1
    out += [("model.norm.weight", [h]), ("lm_head.weight", [vocab, h])]
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(spec: list[tuple[str, list[int]]]) -> int:
    return sum(2 * _numel(s) for _, s in spec)


def pattern(index: int, shape: list[int], device: torch.device) -> torch.Tensor:
    """Tensor `index`'s values: integers 0..255 (exact in bf16), shifted per tensor."""
    n = _numel(shape)
    # reduce before scaling: int32 arange * 7 would overflow past ~300M elements
    vals = ((torch.arange(n, device=device, dtype=torch.int32) % 256) * 7 + index * 13) % 256
    return vals.to(torch.bfloat16).reshape(shape)


def make_source(spec: list[tuple[str, list[int]]], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for i, (name, shape) in enumerate(spec):
        yield name, pattern(i, shape, device)


def make_destination(spec: list[tuple[str, list[int]]], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=torch.bfloat16, device=device) for name, shape in spec}


def mismatches(spec: list[tuple[str, list[int]]], dest: dict[str, torch.Tensor]) -> list[str]:
    """Names whose destination tensor differs from the source pattern."""
    return [name for i, (name, shape) in enumerate(spec)
            if not torch.equal(dest[name], pattern(i, shape, dest[name].device))]
