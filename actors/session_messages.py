"""Wire messages of the session server and the router actors.

The session server answers the same operations over actor asks as over its HTTP
front (create, one chat turn, info, export, close), so a rollout actor in another
process can drive sessions without HTTP. The router takes the engine's `Generate`
and `EndSession` (actors/messages.py) plus the membership/stats messages below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.transport.schema import message


# ------------------------------------------------------------------ session server
@message("session.Create")
@dataclass
class CreateSession:
    """Open a session; reply {"session_id", "base_url"}. Empty id/key = generated/the id."""

    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""
    routing_key: str = ""


@message("session.Chat")
@dataclass
class ChatTurn:
    """One turn: the whole message history (OpenAI form); reply {"message", "finish_reason", "usage"}."""

    session_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@message("session.Get")
@dataclass
class GetSession:
    session_id: str


@message("session.Export")
@dataclass
class ExportSamples:
    """The session's trajectories as `Sample.to_wire()` dicts (routed experts as arrays)."""

    session_id: str


@message("session.Close")
@dataclass
class CloseSession:
    session_id: str


@message("session.ServerInfo")
@dataclass
class ServerInfo:
    """Reply {"url": the HTTP front's root URL, "sessions": open sessions, "turns": turns served}."""


# ------------------------------------------------------------------ router
@message("router.AddEngine")
@dataclass
class AddEngine:
    name: str


@message("router.RemoveEngine")
@dataclass
class RemoveEngine:
    name: str


@message("router.Stats")
@dataclass
class RouterStats:
    """Reply: RouterPolicy.stats() plus request/retry/removal counters."""
