"""Wire codec: msgpack envelopes with arrays and tensors as out-of-band zero-copy frames.

A message is a list of frames: frame 0 is a msgpack header, frames 1.. are raw
buffers referenced from the header by (dtype, shape, frame index). bf16 travels
as its raw 16-bit words. Nothing is ever pickled; every decode path validates
and raises `ProtocolError` with what was wrong.
"""

from __future__ import annotations

import math
import traceback as tb_mod
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from miles.core.errors import ProtocolError
from miles.transport.schema import build, spec_for_name, spec_for_obj

PROTO = 1
ASK, TELL, REPLY, ERROR, BATCH = 0, 1, 2, 3, 4
KINDS = (ASK, TELL, REPLY, ERROR, BATCH)
EXT_NDARRAY, EXT_TENSOR, EXT_RECORD = 1, 2, 3
MAX_HEADER_BYTES = 64 << 20
MAX_NDIM = 8
DEFAULT_MAX_FRAME_BYTES = 4 << 30

_NP_DTYPES = {
    np.dtype(t).str: np.dtype(t)
    for t in ("bool", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")
}
_TORCH_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64", "bfloat16",
)


@dataclass(slots=True)
class Envelope:
    """A decoded message: kind, request id, target actor, type, deadline and body."""

    kind: int
    msg_id: int | None
    target: str
    type_name: str
    version: int
    deadline_s: float | None
    body: Any
    sender: str = ""


def _torch() -> Any:
    import torch

    return torch


class Encoder:
    """Packs one message; collects out-of-band frames while packing."""

    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.str not in _NP_DTYPES and obj.dtype.str.replace(">", "<") not in _NP_DTYPES:
                raise ProtocolError(f"array dtype {obj.dtype} cannot travel on the wire")
            arr = np.ascontiguousarray(obj)
            self.frames.append(arr)
            return msgpack.ExtType(
                EXT_NDARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), len(self.frames)])
            )
        if type(obj).__name__ == "Tensor" and type(obj).__module__.startswith("torch"):
            return self._tensor(obj)
        spec = spec_for_obj(obj)
        if spec is not None:
            fields = {f: getattr(obj, f) for f in spec.fields}
            return msgpack.ExtType(
                EXT_RECORD,
                msgpack.packb([spec.name, spec.version, fields], default=self._default),
            )
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return list(obj)
        raise ProtocolError(f"cannot encode {type(obj).__name__} on the wire (register it with @message)")

    def _tensor(self, t: Any) -> Any:
        torch = _torch()
        if t.device.type != "cpu":
            raise ProtocolError(
                f"tensor on {t.device} cannot travel on the control wire; use a bulk channel"
            )
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_NAMES:
            raise ProtocolError(f"tensor dtype {t.dtype} cannot travel on the wire")
        t = t.detach().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        self.frames.append(raw.numpy())
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, list(t.shape), len(self.frames)]))

    def pack(self, header: list[Any]) -> list[Any]:
        head = msgpack.packb(header, default=self._default, use_bin_type=True)
        return [head, *self.frames]


def encode(
    kind: int,
    msg_id: int | None,
    target: str,
    payload: Any,
    deadline_s: float | None = None,
    sender: str = "",
) -> list[Any]:
    """Frames for one ask/tell/reply whose payload is a registered record or plain value."""
    enc = Encoder()
    spec = spec_for_obj(payload)
    if spec is not None:
        body: Any = {f: getattr(payload, f) for f in spec.fields}
        header = [PROTO, kind, msg_id, target, spec.name, spec.version, deadline_s, body, sender]
    else:
        header = [PROTO, kind, msg_id, target, "", 0, deadline_s, payload, sender]
    return enc.pack(header)


def encode_batch(target: str, payloads: list[Any], sender: str = "") -> list[Any]:
    """One multipart message carrying many tells to the same actor."""
    enc = Encoder()
    items = []
    for p in payloads:
        spec = spec_for_obj(p)
        if spec is None:
            raise ProtocolError(f"batched tell needs registered records, got {type(p).__name__}")
        items.append([spec.name, spec.version, {f: getattr(p, f) for f in spec.fields}])
    return enc.pack([PROTO, BATCH, None, target, "", 0, None, items, sender])


def encode_error(msg_id: int | None, target: str, exc: BaseException, sender: str = "") -> list[Any]:
    tb = "".join(tb_mod.format_exception(type(exc), exc, exc.__traceback__))
    body = [type(exc).__name__, str(exc), tb[-8000:]]
    return [msgpack.packb([PROTO, ERROR, msg_id, target, "!", 0, None, body, sender])]


class Decoder:
    """Unpacks one message's header, resolving out-of-band frames with validation."""

    __slots__ = ("frames", "used", "max_frame_bytes")

    def __init__(self, frames: list[Any], max_frame_bytes: int) -> None:
        self.frames = frames
        self.used: set[int] = set()
        self.max_frame_bytes = max_frame_bytes

    def _buffer(self, idx: Any, nbytes: int, what: str) -> memoryview:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 1 <= idx < len(self.frames):
            raise ProtocolError(f"{what}: frame index {idx!r} out of range (have {len(self.frames) - 1})")
        if idx in self.used:
            raise ProtocolError(f"{what}: frame {idx} referenced twice")
        self.used.add(idx)
        f = self.frames[idx]
        buf = memoryview(f.buffer if hasattr(f, "buffer") else f)
        if buf.nbytes != nbytes:
            raise ProtocolError(f"{what}: declared {nbytes} bytes, frame {idx} holds {buf.nbytes}")
        return buf

    def _shape(self, shape: Any, itemsize: int, what: str) -> int:
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise ProtocolError(f"{what}: shape must be a list of at most {MAX_NDIM} dims")
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ProtocolError(f"{what}: bad dimension {d!r} in shape {shape!r}")
        nbytes = math.prod(shape) * itemsize
        if nbytes > self.max_frame_bytes:
            raise ProtocolError(f"{what}: declared size {nbytes} bytes exceeds the limit {self.max_frame_bytes}")
        return nbytes

    def _ext(self, code: int, data: bytes) -> Any:
        try:
            meta = msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"malformed ext payload: {exc}") from exc
        if not isinstance(meta, list) or len(meta) != 3:
            raise ProtocolError(f"ext type {code}: expected a 3-item header")
        if code == EXT_NDARRAY:
            dt = _NP_DTYPES.get(meta[0]) if isinstance(meta[0], str) else None
            if dt is None:
                raise ProtocolError(f"array: unsupported dtype {meta[0]!r}")
            nbytes = self._shape(meta[1], dt.itemsize, "array")
            buf = self._buffer(meta[2], nbytes, "array")
            return np.frombuffer(buf, dtype=dt).reshape(meta[1])
        if code == EXT_TENSOR:
            return self._tensor(meta)
        if code == EXT_RECORD:
            name, version, fields = meta
            if not isinstance(name, str):
                raise ProtocolError("record: type name must be a string")
            return build(spec_for_name(name), version, fields)
        raise ProtocolError(f"unknown ext type {code}")

    def _tensor(self, meta: list[Any]) -> Any:
        torch = _torch()
        name = meta[0]
        if name not in _TORCH_NAMES:
            raise ProtocolError(f"tensor: unsupported dtype {name!r}")
        dtype = getattr(torch, name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = self._shape(meta[1], itemsize, "tensor")
        buf = self._buffer(meta[2], nbytes, "tensor")
        if nbytes == 0:
            return torch.empty(meta[1], dtype=dtype)
        with warnings.catch_warnings():
            # Frames are read-only; the receiver owns the tensor and must clone before writing.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=dtype).reshape(meta[1])

    def header(self) -> list[Any]:
        if not self.frames:
            raise ProtocolError("empty message")
        f0 = self.frames[0]
        head = f0.bytes if hasattr(f0, "bytes") else bytes(f0)
        if len(head) > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            h = msgpack.unpackb(head, ext_hook=self._ext, raw=False, strict_map_key=False)
        except ProtocolError:
            raise
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
        if not isinstance(h, list) or len(h) != 9:
            raise ProtocolError("header must be a 9-item array")
        if h[0] != PROTO:
            raise ProtocolError(f"protocol version {h[0]!r}, this side speaks {PROTO}")
        return h


def peek_reply_route(frames: list[Any]) -> tuple[int | None, str]:
    """Best-effort (msg_id, target) of a malformed message, so its error can still be answered."""
    try:
        f0 = frames[0]
        h = msgpack.unpackb(f0.bytes if hasattr(f0, "bytes") else bytes(f0), raw=False,
                            strict_map_key=False, ext_hook=lambda c, d: None)
        if isinstance(h, list) and len(h) >= 4 and h[1] == ASK:
            mid = h[2] if isinstance(h[2], int) and not isinstance(h[2], bool) else None
            return mid, h[3] if isinstance(h[3], str) else ""
    except Exception:  # noqa: BLE001 - any failure just means "cannot route a reply"
        pass
    return None, ""


def decode(frames: list[Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Envelope:
    """Validate and decode one message; raises ProtocolError on anything malformed."""
    dec = Decoder(frames, max_frame_bytes)
    _, kind, msg_id, target, type_name, version, deadline_s, body, sender = dec.header()
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if msg_id is not None and (not isinstance(msg_id, int) or isinstance(msg_id, bool)):
        raise ProtocolError(f"message id must be an integer, got {type(msg_id).__name__}")
    if kind == ASK and msg_id is None:
        raise ProtocolError("a request must carry an id")
    if not isinstance(target, str) or not isinstance(type_name, str) or not isinstance(sender, str):
        raise ProtocolError("target, type and sender must be strings")
    if deadline_s is not None and (not isinstance(deadline_s, int | float) or isinstance(deadline_s, bool)):
        raise ProtocolError("deadline must be a number of seconds")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError("schema version must be an integer")
    if kind == ERROR:
        if not (isinstance(body, list) and len(body) == 3 and all(isinstance(x, str) for x in body)):
            raise ProtocolError("error body must be [type, message, traceback]")
    elif kind == BATCH:
        if not isinstance(body, list):
            raise ProtocolError("batch body must be a list")
        out = []
        for i, item in enumerate(body):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
                raise ProtocolError(f"batch item {i} must be [type, version, fields]")
            out.append(build(spec_for_name(item[0]), item[1], item[2], f"batch[{i}].{item[0]}"))
        body = out
    elif type_name:
        body = build(spec_for_name(type_name), version, body)
    elif kind in (ASK, TELL):
        raise ProtocolError("requests must name a registered message type")
    if len(dec.used) != len(frames) - 1:
        raise ProtocolError(f"{len(frames) - 1 - len(dec.used)} frame(s) not referenced by the header")
    return Envelope(kind, msg_id, target, type_name, version, deadline_s, body, sender)
