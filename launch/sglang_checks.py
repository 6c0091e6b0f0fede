"""What a launched SGLang engine (engine.type = "sglang", SGLang 0.5.17) cannot do, refused at
launch with the reason and the fix, before any process starts or a GPU is allocated.

The model facts come from model.path's config.json, or from the tiny preset's config with
model.overrides when no path is given (the preset checkpoint is written later).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.core.schema import MilesConfig

# sglang/srt/layers/rotary_embedding/base.py (0.5.17): on CUDA, rotary embeddings of other head
# sizes use a fallback kernel, and the attention layers' fused rope + KV-cache write then fails at
# the first forward: "AssertionError: save kv cache is not supported for fallback_rotary_embedding".
ROPE_HEAD_SIZES = (64, 128, 256, 512)


def model_config(cfg: MilesConfig) -> dict[str, Any]:
    """The HF config the engines will serve: model.path's, else the tiny preset's."""
    if cfg.model.path:
        f = Path(cfg.model.path) / "config.json"
        return json.loads(f.read_text()) if f.is_file() else {}
    from miles.models.presets import tiny_config

    overrides: dict[str, Any] = cfg.model.overrides  # typed per value: vocab_size may be one
    return tiny_config(cfg.model.arch, **overrides)


def _head_dim(hf: dict[str, Any]) -> int | None:
    if "kv_lora_rank" in hf:  # MLA (DeepSeek-style): SGLang's own MLA rope path, not this kernel
        return None
    hd = hf.get("head_dim")
    if hd:
        return int(hd)
    heads = int(hf.get("num_attention_heads") or 0)
    return int(hf["hidden_size"]) // heads if heads and hf.get("hidden_size") else None


def sglang_launch_errors(cfg: MilesConfig) -> list[str]:
    """Every reason this config cannot run on launched SGLang servers, each with its fix."""
    eng = cfg.engine
    if eng.type != "sglang":
        return []
    errs: list[str] = []
    if cfg.sync.pause_mode in ("in_place", "none"):
        errs.append(
            f"sync.pause_mode={cfg.sync.pause_mode} is not available with engine.type=sglang: SGLang reports one "
            "weight_version per response, so tokens of a request that runs across a commit cannot be given their "
            "versions; use sync.pause_mode=retract (the default for sglang, 'auto') or abort")
    if eng.dtype == "float32":
        errs.append("engine.dtype=float32 is not available with engine.type=sglang: its rmsnorm kernel has no "
                    "float32 (the server dies at start); use engine.dtype=bfloat16 (the default for sglang, 'auto')")
    hf = model_config(cfg)
    if "vision_config" in hf:
        errs.append("a vision-language model is not available with engine.type=sglang: miles' SGLang engine sends "
                    "token ids only, so the images of a request would never reach the server; use engine.type=torch")
    hd = _head_dim(hf)
    if hd is not None and hd not in ROPE_HEAD_SIZES:
        fix = ("set model.overrides.head_dim to one of them (the tiny preset)" if not cfg.model.path
               else "serve a model whose head_dim is one of them, or use engine.type=torch")
        errs.append(f"head_dim={hd} is not available with engine.type=sglang: SGLang's CUDA rotary kernel takes "
                    f"head sizes {', '.join(map(str, ROPE_HEAD_SIZES))}; others fall back to a kernel its fused "
                    f"KV-cache write refuses ('save kv cache is not supported for fallback_rotary_embedding'); {fix}")
    errs += _layout_errors(cfg, hf)
    return errs


def _layout_errors(cfg: MilesConfig, hf: dict[str, Any]) -> list[str]:
    eng = cfg.engine
    errs: list[str] = []
    heads, kv = int(hf.get("num_attention_heads") or 0), int(hf.get("num_key_value_heads") or 0)
    tp = eng.sglang_tp
    if heads and heads % tp:
        errs.append(f"engine.sglang_tp={tp} does not divide the model's {heads} attention heads: pick a tp that does")
    if kv and tp > 1 and (kv % tp if kv >= tp else tp % kv):
        errs.append(f"engine.sglang_tp={tp} and the model's {kv} KV heads: one must divide the other "
                    "(SGLang splits KV heads, or replicates them when there are fewer)")
    if eng.sglang_url and eng.num_engines > 1:
        errs.append(f"engine.sglang_url names one running server, engine.num_engines={eng.num_engines}: every "
                    "engine would drive the same server; leave sglang_url empty to launch one server per engine, "
                    "or set num_engines=1")
    if eng.sglang_url and eng.sglang_weight_update == "tensor":
        errs.append("engine.sglang_weight_update=tensor hands tensors over by reference, which only a server on "
                    "this machine can map; with engine.sglang_url use 'disk' (a folder the server can read)")
    last_port = eng.sglang_port + eng.num_engines + int(cfg.eval.mode == "snapshot") - 1
    if not eng.sglang_url and last_port > 65535:
        errs.append(f"engine.sglang_port={eng.sglang_port}: engines listen on sglang_port + index, up to "
                    f"{last_port} > 65535; lower it")
    if not eng.sglang_url:
        k = eng.servers_per_gpu(cfg.eval.mode == "snapshot")
        budget = eng.sglang_mem_budget(cfg.trainer.device != "cpu")
        if k * eng.sglang_mem_fraction > budget + 1e-9:
            who = f"{k} servers share a GPU (sglang_placement={eng.sglang_placement})"
            errs.append(
                f"engine.sglang_mem_fraction={eng.sglang_mem_fraction}: {who}, together "
                f"{k * eng.sglang_mem_fraction:.2f} of its memory, over the budget of {budget}"
                f"{' with the trainer on the GPU' if cfg.trainer.device != 'cpu' else ''}; set it to at most "
                f"{budget / k:.3f} (0 = auto), or sglang_placement=spread to give each server its own GPUs")
    # trainer.pause_engines needs in-place pauses: refused at load for every engine but torch's
    # (core/schema/resolve.py check)
    return errs
