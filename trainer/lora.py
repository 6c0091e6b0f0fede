"""LoRA RL: low-rank adapters on chosen linear layers; only the adapters train and sync.

An adapted layer's weight becomes a parametrization (`torch.nn.utils.parametrize`):
reading `layer.weight` gives W0 + (alpha / r) * B @ A, so the shared model code, which
reads the weight and calls `F.linear`, needs no change. W0 is frozen; A (r x in, seeded
normal) and B (out x r, zeros, so training starts at the base model) are the only
trainable parameters. `merge_weight` is the one definition of the merged weight, used by
the trainer's forward and by the engine side (`engines/lora.py`) when it re-merges synced
adapters onto its kept base weights (`miles.models.lora`), so both hold bit-identical weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from miles.core.errors import ConfigError
from miles.core.schema.trainer import LoraConfig
from miles.models.decoder import CausalLM
from miles.models.hf_io import hf_tensor_views
from miles.models.lora import SCALE_NAME, merge_weight, scale_tensor
from miles.trainer.checkpoint import _OneParam
from miles.trainer.sharding import is_dtensor

_ORIG = ".parametrizations.weight.original"


class LoraDelta(nn.Module):
    """The parametrization W0 -> W0 + scale * B @ A (A and B are its parameters)."""

    def __init__(self, out_f: int, in_f: int, rank: int, scale: float, g: torch.Generator) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(rank, in_f, generator=g) / rank)
        self.lora_B = nn.Parameter(torch.zeros(out_f, rank))
        self.scale = scale

    def forward(self, w0: torch.Tensor) -> torch.Tensor:
        return merge_weight(w0, self.lora_A, self.lora_B, self.scale)


def apply_lora(model: CausalLM, cfg: LoraConfig, seed: int) -> list[str]:
    """Freeze `model` and add adapters to every nn.Linear whose name ends in a target;
    returns the adapted module names. Call before sharding."""
    if cfg.rank < 1:
        raise ConfigError(f"trainer.lora.rank={cfg.rank}: must be >= 1 to apply LoRA")
    g = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    done = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.targets:
            out_f, in_f = mod.weight.shape
            delta = LoraDelta(out_f, in_f, cfg.rank, cfg.alpha / cfg.rank, g)
            parametrize.register_parametrization(mod, "weight", delta)
            done.append(name)
    if not done:
        raise ConfigError(f"trainer.lora.targets={cfg.targets}: no linear layer matches")
    return done


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if is_dtensor(t) else t).detach()


def iter_adapters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name + '.lora_A' / '.lora_B', full tensor): only the adapter bytes; a
    collective with FSDP (every rank drains it)."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoraDelta):
            layer = name.removesuffix(".parametrizations.weight.0")
            yield f"{layer}.lora_A", _full(mod.lora_A)
            yield f"{layer}.lora_B", _full(mod.lora_B)


def iter_adapter_payload(model: nn.Module, cfg: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter-only sync payload (`miles.models.lora`): every adapter, then the scale."""
    yield from iter_adapters(model)
    yield SCALE_NAME, scale_tensor(cfg.alpha / cfg.rank)


def iter_merged_hf_state(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with adapters merged (for checkpoints and full syncs)."""
    mods = dict(model.named_modules())
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        full = _full(p)
        if name.endswith(_ORIG):
            layer = name.removesuffix(_ORIG)
            delta = mods[f"{layer}.parametrizations.weight.0"]
            full = merge_weight(full, _full(delta.lora_A), _full(delta.lora_B), delta.scale)
            name = f"{layer}.weight"
        yield from hf_tensor_views(_OneParam(model.spec, name, full)).items()


def export_merged(path: str | Path, model: CausalLM) -> None:
    """An HF checkpoint of the merged weights, written by rank 0 (every rank must call)."""
    from miles.trainer.checkpoint import export_hf

    export_hf(path, model, iter_merged_hf_state(model))
