"""GGUF file -> HF checkpoint directory, and the manifest that lets a later call only check it.

transformers' GGUF reader (it needs the `gguf` package) dequantizes the 4-8-bit blocks and
rebuilds the config, the tokenizer and the chat template from the GGUF metadata. The weights are
saved in the model's registry dtype (see packaged/registry.py for each choice): dequantized
blocks are products of an fp16 scale and small integers, so fp32 holds them exactly, bf16 rounds
them to 8 significant bits - an error below a tenth of the 4-bit quantization step already in them.

The directory is written beside OUT and renamed into place, so OUT is either absent or complete.
`miles_packaged.json` records the model, the GGUF's sha256, the dtype and every file's size and
sha256; a second `miles fetch-model` call re-hashes the files against it instead of converting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from miles.core.errors import MilesError
from miles.packaged.parts import CHUNK, IntegrityError
from miles.packaged.registry import PackagedModel

MANIFEST = "miles_packaged.json"
DTYPES = ("bfloat16", "float16", "float32")


class ExtraMissing(MilesError):
    """An optional package the conversion needs is not installed."""


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(CHUNK):
            h.update(buf)
    return h.hexdigest()


def _version(v: str) -> tuple[int, int]:
    major, minor = (v.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def convert(gguf: Path, out: Path, model: PackagedModel, dtype: str) -> dict[str, Any]:
    """Write the HF directory for `gguf` at `out` (which must not exist); return its manifest."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers' GGUF reader imports it by name
        import torch
        import transformers
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ExtraMissing(f"converting a GGUF file needs `pip install 'miles[gguf]'` "
                           f"(transformers, gguf, accelerate): {exc}") from exc
    if dtype not in DTYPES:
        raise MilesError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)  # beside OUT: the final rename stays on one filesystem
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        kw: dict[str, Any] = {}
        if hasattr(transformers, "GgufConfig"):
            # transformers >= 5 keeps GGUF blocks packed where a matmul kernel exists (the GPU
            # machine has `kernels`); the saved checkpoint needs plain dense weights
            kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
        # transformers < 4.56 names the load dtype `torch_dtype`
        kw["dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"] = getattr(torch, dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kw)
        cfg = hf.config.to_dict()
        if cfg.get("model_type") != model.architecture:
            raise IntegrityError(f"{gguf}: transformers reads model_type {cfg.get('model_type')!r}; "
                                 f"{model.name} is {model.architecture!r}")
        cfg.pop("quantization_config", None)  # the saved weights are plain, not GGUF blocks
        cfg.pop("_name_or_path", None)  # the temporary folder the GGUF was joined in
        cfg["architectures"] = [type(hf).__name__]
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tensors = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
        packed = sorted(k for k, v in tensors.items() if v.dtype != getattr(torch, dtype))
        if packed:
            raise IntegrityError(f"{gguf}: transformers {transformers.__version__} left {len(packed)} tensors "
                                 f"undequantized (e.g. {packed[0]}); a dense {dtype} checkpoint cannot be saved")
        if cfg.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del hf, tensors
        tok.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
        manifest = {
            "model": model.name, "title": model.title, "gguf_sha256": model.sha256, "dtype": dtype,
            "converted_by": f"miles fetch-model (transformers {transformers.__version__})",
            "files": {p.name: {"size": p.stat().st_size, "sha256": _file_sha256(p)}
                      for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise IntegrityError(f"{path}: no 'files' table; remove {out} (or pass --force) to convert again")
    return data


def check_converted(out: Path, model: PackagedModel, manifest: dict[str, Any]) -> None:
    """OUT is the conversion of this model's GGUF and no file changed since."""
    if manifest.get("model") != model.name or manifest.get("gguf_sha256") != model.sha256:
        raise IntegrityError(f"{out} holds {manifest.get('model')!r} (GGUF sha256 {manifest.get('gguf_sha256')}), "
                             f"not {model.name!r}; choose another --out or pass --force")
    for name, want in manifest["files"].items():
        p = out / name
        if not p.is_file():
            raise IntegrityError(f"{p} is missing (listed in {MANIFEST}); pass --force to convert again")
        size, digest = p.stat().st_size, _file_sha256(p)
        if size != want.get("size") or digest != want.get("sha256"):
            raise IntegrityError(f"{p}: {size} bytes, sha256 {digest}; {MANIFEST} recorded "
                                 f"{want.get('size')} bytes, sha256 {want.get('sha256')}; pass --force to "
                                 "convert again")
