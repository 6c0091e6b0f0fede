"""Hugging Face checkpoint IO: HF tensor names <-> `CausalLM` parameters, safetensors load/save.

A checkpoint directory holds `config.json` plus `model.safetensors` or a sharded
`model.safetensors.index.json`; `save_model` writes the same layout, which
`transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from miles.core.logging import get_logger
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.errors import CheckpointError
from miles.models.fp8_layout import dequantize_hf_state, fp8_block, quantize_hf_state
from miles.models.fp8_model import fp8_hf_names
from miles.models.hf_names import hf_param_slices
from miles.models.registry import build_model

log = get_logger("miles.models.hf_io")


def hf_param_views(spec: ModelSpec, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(HF name, view into `tensor`) for the model parameter `name` whose full value is `tensor`
    (e.g. an FSDP parameter after `full_tensor()`)."""
    return [(s.hf_name, s.view(tensor)) for s in hf_param_slices(spec, name, tensor.shape)]


class NamedParameters(Protocol):
    """What `hf_tensor_views` reads of a model: a CausalLM, or one parameter of it
    (trainer/checkpoint.py's `_OneParam`)."""

    @property
    def spec(self) -> ModelSpec: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


def hf_tensor_views(model: NamedParameters) -> dict[str, torch.Tensor]:
    """HF name -> a view into the model's parameter (row slices of fused projections,
    per-expert slices of stacked experts)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out.update(hf_param_views(model.spec, name, p.data))
    return out


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (views; clone before mutating)."""
    return hf_tensor_views(model)


def hf_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in hf_tensor_views(model).items()}


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh64 hex digest of a tensor's raw bytes (dtype-exact; bf16 hashed as its 16-bit words)."""
    # reshape: a 0-d tensor has no bytes view of another element size
    data = t.detach().contiguous().to("cpu").reshape(-1)
    return xxhash.xxh64(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def checksums(model: CausalLM) -> dict[str, str]:
    return {k: tensor_checksum(v) for k, v in hf_tensor_views(model).items()}


@torch.no_grad()
def load_hf_tensors(
    model: CausalLM, named: Iterable[tuple[str, torch.Tensor]], strict: bool = True
) -> set[str]:
    """Copy HF-named tensors into the model (cast to its dtype/device); return the names loaded.

    Unknown or mis-shaped names raise CheckpointError naming the tensor; with `strict`,
    so does any model tensor left unloaded. A tied model ignores `lm_head.weight`.
    """
    views = hf_tensor_views(model)
    seen: set[str] = set()
    mtp: set[str] = set()
    for name, t in named:
        if name not in views:
            if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                continue
            if _is_mtp_layer(model.spec, name):
                mtp.add(name.split(".")[2])
                continue
            raise CheckpointError(f"unexpected tensor {name!r} for {model.spec.architecture}")
        dst = views[name]
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)}, model expects {tuple(dst.shape)}"
            )
        dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
        seen.add(name)
    if strict:
        missing = sorted(set(views) - seen)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
    if mtp:
        log.info("mtp_layers_skipped", layers=sorted(mtp, key=int), reason="multi-token prediction is not used")
    return seen


def _is_mtp_layer(spec: ModelSpec, name: str) -> bool:
    """DeepSeek-V3 / GLM-4.5 checkpoints append their multi-token-prediction modules as
    `model.layers.{num_hidden_layers + i}`; transformers skips them at load too."""
    parts = name.split(".")
    if spec.model_type == "qwen3_next":
        return parts[0] == "mtp"
    return (
        spec.model_type in ("glm4_moe", "deepseek_v3")
        and len(parts) > 2
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and int(parts[2]) >= spec.num_layers
    )


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from model.safetensors or every shard of model.safetensors.index.json."""
    d = Path(path)
    single, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [single.name]
    else:
        raise CheckpointError(f"{str(d)!r} has neither model.safetensors nor model.safetensors.index.json")
    for fname in files:
        f = d / fname
        if not f.is_file():
            raise CheckpointError(f"shard {str(f)!r} listed in the index does not exist")
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield key, sf.get_tensor(key)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model from `path/config.json` and load its safetensors weights (an FP8
    checkpoint's codes and block scales are dequantized: the model computes under the FP8
    contract from the dequantized weights, models/fp8_linear.py)."""
    spec = ModelSpec.from_dir(path)
    model = build_model(spec).to(dtype=dtype)
    load_hf_tensors(model, dequantize_hf_state(iter_checkpoint(path), fp8_block(spec)))
    return model.to(device).eval()


def save_model(model: CausalLM, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors (or shards + index when over `max_shard_bytes`)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    views: Iterable[tuple[str, torch.Tensor]] = hf_tensor_views(model).items()
    block = fp8_block(model.spec)
    if block is not None:  # an FP8 model is saved as a DeepSeek-V3-style FP8 checkpoint
        views = quantize_hf_state(views, block, fp8_hf_names(model.spec))
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in views}
    cfg = dict(model.spec.hf_config)
    dtype = next(model.parameters()).dtype
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(d / "model.safetensors"), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))

