"""Training samples and groups: what the rollout side hands to the buffer and the trainer.

A `Sample` is one trajectory as exact token ids (prompt + response). The loss
mask marks the tokens the policy sampled (1) versus tokens spliced in between
turns - tool results, user turns, template glue - (0). Logprobs and weight
versions are per response token; routed experts (R3) are per token of the whole
sequence. A `Group` is the n samples of one prompt.

`to_wire()` yields plain msgpack-able dicts (lists, str, int, float, numpy
arrays - or `{"dtype","shape","data"}` dicts when `arrays_as_bytes=True`);
`from_wire()` validates every field and names the one that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np

from miles.core.errors import ProtocolError
from miles.core.images import ImageInput

Status = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")
# A token the policy did not sample (prompt glue, tool output) carries this version.
NOT_SAMPLED = -1
WIRE_VERSION = 1


def _int_list(v: Any, where: str) -> list[int]:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise ProtocolError(f"{where}: expected a 1-d integer array, got {v.dtype}{list(v.shape)}")
        return [int(x) for x in v.tolist()]
    if not isinstance(v, list | tuple):
        raise ProtocolError(f"{where}: expected a list of ints, got {type(v).__name__}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int | np.integer):
            raise ProtocolError(f"{where}[{i}]: expected an int, got {x!r}")
    return [int(x) for x in v]


def _float_list(v: Any, where: str) -> list[float]:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "fiu":
            raise ProtocolError(f"{where}: expected a 1-d float array, got {v.dtype}{list(v.shape)}")
        return [float(x) for x in v.tolist()]
    if not isinstance(v, list | tuple):
        raise ProtocolError(f"{where}: expected a list of floats, got {type(v).__name__}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int | float | np.floating | np.integer):
            raise ProtocolError(f"{where}[{i}]: expected a number, got {x!r}")
    return [float(x) for x in v]


def array_to_wire(a: np.ndarray, as_bytes: bool) -> Any:
    """A numpy array for the wire: itself (the codec ships it out of band) or a bytes dict."""
    if not as_bytes:
        return a
    c = np.ascontiguousarray(a)
    return {"dtype": str(c.dtype), "shape": list(c.shape), "data": c.tobytes()}


def array_from_wire(v: Any, where: str) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, dict) and set(v) == {"dtype", "shape", "data"}:
        try:
            dt = np.dtype(v["dtype"])
            shape = tuple(int(s) for s in v["shape"])
            arr = np.frombuffer(v["data"], dtype=dt)
            return arr.reshape(shape).copy()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{where}: bad array header {v['dtype']!r}{v['shape']!r}: {exc}") from exc
    raise ProtocolError(f"{where}: expected an array or {{dtype, shape, data}}, got {type(v).__name__}")


@dataclass
class Sample:
    """One trajectory as exact token ids plus everything the loss needs."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    reward: float | None = None
    status: Status = "completed"
    index: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    # every image of the ids, in order (a VL policy); the ids hold their placeholders expanded
    images: ImageInput | None = None
    # the sampling temperature its sampled tokens were drawn with (0 = greedy): the trainer takes
    # their logprobs under it, so one sample carries what one config option used to assume
    temperature: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def oldest_version(self) -> int | None:
        """The oldest weight version among the tokens the policy sampled (None if none)."""
        sampled = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(sampled) if sampled else None

    def validate(self, where: str = "sample") -> None:
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ProtocolError(f"{where}.{name}: length {got} != len(response_ids) {n}")
        for i, m in enumerate(self.loss_mask):
            if m not in (0, 1):
                raise ProtocolError(f"{where}.loss_mask[{i}]: expected 0 or 1, got {m!r}")
            if m == 0 and self.rollout_logprobs[i] != 0.0:
                raise ProtocolError(f"{where}.rollout_logprobs[{i}]: must be 0 where loss_mask is 0")
        if self.status not in STATUSES:
            raise ProtocolError(f"{where}.status: {self.status!r} is not one of {', '.join(STATUSES)}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t < float("inf"):
            raise ProtocolError(f"{where}.temperature: expected a finite number >= 0, got {t!r}")
        self.temperature = float(t)
        re = self.routed_experts
        if re is not None:
            if not isinstance(re, np.ndarray) or re.ndim != 3 or re.dtype not in (np.uint8, np.uint16):
                desc = f"{re.dtype}{list(re.shape)}" if isinstance(re, np.ndarray) else type(re).__name__
                raise ProtocolError(f"{where}.routed_experts: expected uint8/uint16 [T, L, k], got {desc}")
            if re.shape[0] != self.num_tokens:
                raise ProtocolError(
                    f"{where}.routed_experts: {re.shape[0]} rows != prompt+response tokens {self.num_tokens}"
                )

    def to_wire(self, arrays_as_bytes: bool = False) -> dict[str, Any]:
        re = self.routed_experts
        return {
            "v": WIRE_VERSION,
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "loss_mask": list(self.loss_mask),
            "rollout_logprobs": list(self.rollout_logprobs),
            "versions": list(self.versions),
            "routed_experts": None if re is None else array_to_wire(re, arrays_as_bytes),
            "reward": self.reward,
            "status": self.status,
            "index": self.index,
            "metadata": dict(self.metadata),
            "temperature": self.temperature,
            **({} if self.images is None else {"images": {
                k: array_to_wire(a, arrays_as_bytes) for k, a in self.images.to_wire().items()}}),
        }

    @classmethod
    def from_wire(cls, d: Any, where: str = "sample") -> Sample:
        if not isinstance(d, dict):
            raise ProtocolError(f"{where}: expected a dict, got {type(d).__name__}")
        known = {"v", "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "versions",
                 "routed_experts", "reward", "status", "index", "metadata", "images", "temperature"}
        extra = set(d) - known
        if extra:
            raise ProtocolError(f"{where}: unknown fields {sorted(extra)}")
        if d.get("v", WIRE_VERSION) != WIRE_VERSION:
            raise ProtocolError(f"{where}.v: wire version {d.get('v')!r}, this build reads {WIRE_VERSION}")
        if "prompt_ids" not in d:
            raise ProtocolError(f"{where}.prompt_ids: missing")
        reward = d.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise ProtocolError(f"{where}.reward: expected a number or null, got {reward!r}")
        index = d.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ProtocolError(f"{where}.index: expected an int, got {index!r}")
        meta = d.get("metadata", {})
        if not isinstance(meta, dict):
            raise ProtocolError(f"{where}.metadata: expected a dict, got {type(meta).__name__}")
        status = d.get("status", "completed")
        if status not in STATUSES:
            raise ProtocolError(f"{where}.status: {status!r} is not one of {', '.join(STATUSES)}")
        re = d.get("routed_experts")
        imgs = d.get("images")
        if imgs is not None:
            if not isinstance(imgs, dict):
                raise ProtocolError(f"{where}.images: expected {{pixels, grid}}, got {type(imgs).__name__}")
            imgs = ImageInput.from_wire({k: array_from_wire(v, f"{where}.images.{k}") for k, v in imgs.items()},
                                        f"{where}.images")
        try:
            return cls(
                prompt_ids=_int_list(d["prompt_ids"], f"{where}.prompt_ids"),
                response_ids=_int_list(d.get("response_ids", []), f"{where}.response_ids"),
                loss_mask=_int_list(d.get("loss_mask", []), f"{where}.loss_mask"),
                rollout_logprobs=_float_list(d.get("rollout_logprobs", []), f"{where}.rollout_logprobs"),
                versions=_int_list(d.get("versions", []), f"{where}.versions"),
                routed_experts=None if re is None else array_from_wire(re, f"{where}.routed_experts"),
                reward=None if reward is None else float(reward),
                status=cast(Status, status),
                index=index,
                metadata=meta,
                images=imgs,
                temperature=d.get("temperature", 1.0),
            )
        except ProtocolError as exc:
            # __post_init__ names the object "sample"; re-anchor the message at `where`.
            msg = str(exc)
            if msg.startswith("sample."):
                msg = where + msg[len("sample") :]
            raise ProtocolError(msg) from None


@dataclass
class Group:
    """The n samples generated for one prompt; the unit the buffer counts and drops."""

    prompt_id: str
    samples: list[Sample]
    prompt_index: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    def failed(self) -> bool:
        """True when any sample was aborted or errored (the buffer drops such groups)."""
        return any(s.status in ("aborted", "failed") for s in self.samples)

    def failure(self) -> str:
        """Why a failed group failed, for its drop's log line: the bad samples' statuses and the
        first error any of them carries (an `aborted` sample was cut by its engine, with no error)."""
        bad = [s for s in self.samples if s.status in ("aborted", "failed")]
        errors = sorted({str(s.metadata["error"]) for s in bad if s.metadata.get("error")})
        what = f"{len(bad)} of {len(self.samples)} samples {'/'.join(sorted({s.status for s in bad}))}"
        return f"{what}: {errors[0]}" if errors else what

    def oldest_version(self) -> int | None:
        vs = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return min(vs) if vs else None

    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def to_wire(self, arrays_as_bytes: bool = False) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "prompt_id": self.prompt_id,
            "prompt_index": self.prompt_index,
            "samples": [s.to_wire(arrays_as_bytes) for s in self.samples],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_wire(cls, d: Any, where: str = "group") -> Group:
        if not isinstance(d, dict):
            raise ProtocolError(f"{where}: expected a dict, got {type(d).__name__}")
        extra = set(d) - {"v", "prompt_id", "prompt_index", "samples", "metadata"}
        if extra:
            raise ProtocolError(f"{where}: unknown fields {sorted(extra)}")
        if d.get("v", WIRE_VERSION) != WIRE_VERSION:
            raise ProtocolError(f"{where}.v: wire version {d.get('v')!r}, this build reads {WIRE_VERSION}")
        pid = d.get("prompt_id")
        if not isinstance(pid, str):
            raise ProtocolError(f"{where}.prompt_id: expected a string, got {pid!r}")
        pidx = d.get("prompt_index", 0)
        if isinstance(pidx, bool) or not isinstance(pidx, int):
            raise ProtocolError(f"{where}.prompt_index: expected an int, got {pidx!r}")
        samples = d.get("samples")
        if not isinstance(samples, list):
            raise ProtocolError(f"{where}.samples: expected a list, got {type(samples).__name__}")
        meta = d.get("metadata", {})
        if not isinstance(meta, dict):
            raise ProtocolError(f"{where}.metadata: expected a dict, got {type(meta).__name__}")
        return cls(
            prompt_id=pid,
            prompt_index=pidx,
            samples=[Sample.from_wire(s, f"{where}.samples[{i}]") for i, s in enumerate(samples)],
            metadata=meta,
        )
