"""The plain values one turn travels as: the engine's input (`TurnPlan`, `OneTurn`) and the
committed answer (`TurnResult`). The session store (store.py) makes and takes them; the session
service sends a plan over the wire (`to_wire` / `from_wire`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.core.errors import ProtocolError
from miles.core.images import ImageInput


@dataclass
class TurnPlan:
    """What to send to the engine for one turn (plain values; `to_wire` for the wire)."""

    session_id: str
    plan_id: str
    parent: int
    prompt_ids: list[int]
    num_cached: int  # leading prompt ids already stored (the engine's prefix-cache candidate)
    routing_key: str = ""
    images: ImageInput | None = None  # every image of prompt_ids, in order (send with the ids)

    def to_wire(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "plan_id": self.plan_id, "parent": self.parent,
                "prompt_ids": self.prompt_ids, "num_cached": self.num_cached,
                "routing_key": self.routing_key}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TurnPlan:
        try:
            return cls(str(d["session_id"]), str(d["plan_id"]), int(d["parent"]),
                       [int(x) for x in d["prompt_ids"]], int(d["num_cached"]),
                       str(d.get("routing_key", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"turn plan: malformed ({exc!r})") from exc


@dataclass
class TurnResult:
    """The committed turn: the assistant message in OpenAI form plus token accounting."""

    message: dict[str, Any]
    finish_reason: str  # OpenAI finish_reason: stop | length | tool_calls | abort | error
    node: int
    prompt_tokens: int
    completion_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class OneTurn:
    """The prompt of a one-turn trajectory that keeps no session (see `SessionStore.prepare_one`)."""

    prompt_ids: list[int]
    metadata: dict[str, Any]
    images: ImageInput | None = None  # every image of prompt_ids, in order
    temperature: float = 1.0  # what the turn samples at (`SessionStore.turn_temperature`)
