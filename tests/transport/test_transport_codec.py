"""Codec round trips, zero-copy frames, and rejection of malformed input."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch

from miles.core.errors import ProtocolError
from miles.transport.codec import ASK, BATCH, REPLY, TELL, decode, encode, encode_batch
from miles.transport.schema import message


@message("test.Inner")
@dataclass
class Inner:
    x: int
    tag: str = "a"


@message("test.Outer")
@dataclass
class Outer:
    name: str
    values: list[float]
    arr: np.ndarray
    ten: torch.Tensor
    inner: Inner
    opt: int | None = None
    meta: dict[str, int] = field(default_factory=dict)


def _roundtrip(frames: list) -> object:
    return decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in frames])


def test_record_roundtrip_with_arrays_and_bf16() -> None:
    arr = np.arange(100_000, dtype=np.float32).reshape(1000, 100)
    ten = torch.randn(7, 3).to(torch.bfloat16)
    msg = Outer("n", [1.0, 2.5], arr, ten, Inner(3), meta={"k": 1})
    frames = encode(ASK, 7, "actor", msg, deadline_s=1.5, sender="me")
    assert len(frames) == 3  # header + two out-of-band frames
    env = _roundtrip(frames)
    assert env.kind == ASK and env.msg_id == 7 and env.target == "actor" and env.deadline_s == 1.5
    out = env.body
    assert isinstance(out, Outer) and out.inner == Inner(3) and out.meta == {"k": 1}
    np.testing.assert_array_equal(out.arr, arr)
    assert out.ten.dtype == torch.bfloat16 and torch.equal(out.ten, ten)


def test_plain_reply_value() -> None:
    env = _roundtrip(encode(REPLY, 1, "", {"a": [1, 2], "b": np.ones(3, np.int64)}))
    assert env.body["a"] == [1, 2] and env.body["b"].tolist() == [1, 1, 1]


def test_batch() -> None:
    env = _roundtrip(encode_batch("t", [Inner(i) for i in range(5)]))
    assert env.kind == BATCH and [m.x for m in env.body] == list(range(5))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda h: h.__setitem__(0, 99), "protocol version"),
        (lambda h: h.__setitem__(1, 42), "kind"),
        (lambda h: h.__setitem__(4, "no.such"), "unknown message type"),
        (lambda h: h.__setitem__(5, 3), "schema version"),
        (lambda h: h[7].__setitem__("x", "str"), "expected an integer"),
        (lambda h: h[7].__setitem__("bogus", 1), "unknown field"),
        (lambda h: h[7].pop("x"), "missing field"),
        (lambda h: h.__setitem__(2, None), "must carry an id"),
    ],
)
def test_malformed_headers_raise_protocol_error(mutate, needle) -> None:
    head = msgpack.unpackb(encode(ASK, 1, "t", Inner(1))[0])
    mutate(head)
    with pytest.raises(ProtocolError, match=needle):
        decode([msgpack.packb(head)])


def test_declared_sizes_are_checked() -> None:
    frames = encode(TELL, None, "t", Outer("n", [], np.zeros(4, np.float32), torch.zeros(2), Inner(1)))
    frames = [bytes(memoryview(f)) for f in frames]
    with pytest.raises(ProtocolError, match="declared"):
        decode([frames[0], frames[1][:-1], frames[2]])
    with pytest.raises(ProtocolError, match="out of range"):
        decode(frames[:2])
    huge = msgpack.ExtType(1, msgpack.packb(["<f4", [1 << 40], 1]))
    head = msgpack.packb([1, TELL, None, "t", "", 0, None, {"a": huge}, ""])
    with pytest.raises(ProtocolError):
        decode([head, b"x"])


def test_garbage_is_protocol_error() -> None:
    for junk in [b"", b"\xc1", b"\x93\x01", msgpack.packb({"a": 1}), b"\xff" * 50]:
        with pytest.raises(ProtocolError):
            decode([junk])


def test_cuda_and_unknown_objects_are_refused() -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(TELL, None, "t", {"x": object()})


def test_no_pickle_in_wire_packages() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg in ("core", "transport", "actors", "engines", "rollout"):
        for path in (root / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                for n in names:
                    assert n.split(".")[0] not in {"pickle", "cloudpickle", "dill", "marshal"}, path


def test_an_engines_health_reply_is_a_checked_record() -> None:
    """The reply to `Health` travels as a typed record: read back as one, and a field of the wrong
    type is refused where it is decoded, naming the field."""
    from miles.engines.health import HealthReply

    reply = HealthReply(version=4, ok=True, paused=False, running=2, queued=0, device="cpu")
    assert _roundtrip(encode(REPLY, 3, "", reply)).body == reply
    bad = HealthReply(version="four", ok=True, paused=False, running=2, queued=0)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="version"):
        _roundtrip(encode(REPLY, 3, "", bad))


def test_an_engines_generate_reply_is_a_checked_record() -> None:
    """The reply to `Generate` is core's GenerateResult on the wire, its routed experts a zero-copy
    frame; a GenerateMany reply is a list of them with a GenerateFailed for a request that failed
    alone. A field of the wrong type, or a finish reason the contract lacks, is refused where it is
    decoded, naming the field."""
    import numpy as np

    import miles.actors.messages  # noqa: F401 - registers the replies, as every asking process does
    from miles.core.generation import GenerateFailed, GenerateResult

    routed = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    r = GenerateResult("req-1", [7, 8], [-0.5, -1.0], "length", [3, 3], 3, 1, routed_experts=routed)
    back = _roundtrip(encode(REPLY, 3, "", r)).body
    assert isinstance(back, GenerateResult) and back.output_ids == [7, 8] and back.finish_reason == "length"
    assert back.routed_experts is not None and back.routed_experts.dtype == np.uint8
    assert np.array_equal(back.routed_experts, routed)
    many = _roundtrip(encode(REPLY, 4, "", [r, GenerateFailed("EngineError", "bogus")])).body
    assert isinstance(many[0], GenerateResult) and many[1] == GenerateFailed("EngineError", "bogus")
    with pytest.raises(ProtocolError, match="finish_reason"):
        _roundtrip(encode(REPLY, 3, "", GenerateResult("req-1", [7], [-0.5], "banana", [3], 3, 0)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="output_ids"):
        _roundtrip(encode(REPLY, 3, "", GenerateResult("req-1", ["7"], [-0.5], "stop", [3], 3, 0)))  # type: ignore[list-item]


def test_a_process_that_loads_only_the_messages_can_read_a_health_reply() -> None:
    """The rollout process decodes Health replies (its watchers ask down engines and judges) and
    never imports torch or engines/base.py: the record is registered by actors/messages.py alone."""
    import subprocess
    import sys

    code = ("import sys, miles.actors.messages\n"
            "from miles.transport.schema import spec_for_name\n"
            "assert spec_for_name('engine.HealthReply').cls.__name__ == 'HealthReply'\n"
            "assert spec_for_name('engine.GenerateResult').cls.__name__ == 'GenerateResult'\n"
            "assert spec_for_name('engine.GenerateFailed').cls.__name__ == 'GenerateFailed'\n"
            "assert 'torch' not in sys.modules, 'actors/messages.py loaded torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
