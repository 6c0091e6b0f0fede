"""Initial checkpoint for a run: the given one, or a cached supervised warm-up on the task.

With no `model.path`, the tiny preset named by `model.arch` is trained for
`run.warmup_sft_steps` steps on the environment's reference answers, so RL starts
from a policy with a non-zero reward. The result (weights + tokenizer, HF layout)
is cached by a hash of everything that shaped it.

torch, the models and the tokenizer are imported only when a warm-up is trained: the
launcher finds a cached checkpoint without them (~1 s of CPU before any role starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.core.config import to_dict
from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig

if TYPE_CHECKING:
    import torch

log = get_logger("miles.warmup")


def cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))


def _key(cfg: MilesConfig) -> str:
    shaped = {"model": to_dict(cfg.model), "env": cfg.rollout.env, "env_args": cfg.rollout.env_args,
              "steps": cfg.run.warmup_sft_steps, "lr": cfg.run.warmup_lr, "seed": cfg.run.seed, "v": 1}
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


def ensure_initial_checkpoint(cfg: MilesConfig) -> str:
    """Directory of the checkpoint every role loads (config.json + safetensors + tokenizer)."""
    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"model.path {str(p)!r} has no config.json: point it at an HF model directory, "
                "or leave it empty to start from the tiny preset"
            )
        return str(p)
    out = cache_root() / f"init-{cfg.model.arch}-{_key(cfg)}"
    if (out / "config.json").is_file():
        log.info("warmup_cached", path=str(out))
        return str(out)
    import torch

    from miles.models.factory import model_from_config
    from miles.models.hf_io import save_model
    from miles.rollout.tokens.tiny_tokenizer import save_tiny_tokenizer
    from miles.rollout.tokens.tokenizer import load_tokenizer
    from miles.warmup.vl import is_vl_arch

    _remove_orphans(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        save_tiny_tokenizer(tmp, vision=is_vl_arch(cfg.model.arch))  # VL: the image marker's tokens too
        tok = load_tokenizer(tmp)
        torch.manual_seed(cfg.run.seed)
        model = model_from_config(cfg.model, vocab_size=tok.vocab_size, dtype="float32")
        if cfg.run.warmup_sft_steps > 0:
            _sft(cfg, model, tok)
        save_model(model, tmp)
        if not out.exists():  # another launcher may have finished the same warm-up meanwhile
            os.replace(tmp, out)
    finally:  # Ctrl-C or an error mid-way: no half-written warm-up left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("warmup_saved", path=str(out))
    return str(out)


def _remove_orphans(out: Path) -> None:
    """Warm-up temp dirs of launchers that no longer run (killed with SIGKILL mid-warm-up)."""
    for d in out.parent.glob(out.name + ".tmp*"):
        pid = d.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _examples(cfg: MilesConfig, tok: Any, n: int, rng: random.Random) -> list[tuple[list[int], int]]:
    make = resolve_hook(cfg.rollout.env, "rollout.env")
    env = make(**cfg.rollout.env_args)
    out = []
    for _ in range(n):
        p = env.prompts.item(rng.randrange(10**9))
        prompt = tok.apply_chat_template(p["messages"], add_generation_prompt=True)
        full = tok.apply_chat_template([*p["messages"], {"role": "assistant", "content": p["answer"]}])
        ids_p, ids_f = tok.encode(prompt), tok.encode(full)
        if ids_f[: len(ids_p)] != ids_p:
            raise ConfigError("warm-up: the chat template is not append-only for the answer turn")
        # Train through the end-of-turn token so the policy learns to stop.
        end = len(ids_p) + len(tok.encode(p["answer"])) + 1
        out.append((ids_f[:end], len(ids_p)))
    return out


def _sft(cfg: MilesConfig, model: torch.nn.Module, tok: Any, batch: int = 32) -> None:
    import torch

    rng = random.Random(cfg.run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.run.warmup_lr)
    steps = cfg.run.warmup_sft_steps
    vision = getattr(getattr(model, "spec", None), "vision", None)
    env = resolve_hook(cfg.rollout.env, "rollout.env")(**cfg.rollout.env_args) if vision is not None else None
    for step in range(steps):
        if vision is not None:  # a VL preset: prompts with images (warmup/vl.py)
            from miles.warmup.vl import vl_examples, vl_logits

            vex = vl_examples(env, tok, batch, rng, vision.image_token_id, vision.spatial_merge_size)
            ex = [(ids, start) for ids, start, _ in vex]
        else:
            ex = _examples(cfg, tok, batch, rng)
        width = max(len(ids) for ids, _ in ex)
        inp = torch.zeros(len(ex), width, dtype=torch.long)
        tgt = torch.full((len(ex), width), -100, dtype=torch.long)
        for i, (ids, start) in enumerate(ex):
            inp[i, : len(ids)] = torch.tensor(ids)
            tgt[i, start - 1: len(ids) - 1] = torch.tensor(ids[start:])
        # Right padding only: causal attention never looks at the pad positions of a row.
        logits = vl_logits(model, inp, vex) if vision is not None else model(inp).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"warm-up {step + 1}/{steps} | loss {loss.item():.4f}", flush=True)


def with_initial_checkpoint(cfg: MilesConfig) -> MilesConfig:
    """`cfg` with `model.path` set to the (absolute) checkpoint every role loads."""
    import dataclasses

    path = str(Path(ensure_initial_checkpoint(cfg)).resolve())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
