"""Session server actor: the TITO session store behind actor asks and an HTTP front.

A thin shell over `SessionService` (sessions/service.py): every turn's
engine call is an ask to the router actor carrying the session's routing key,
so the router keeps the session on one engine and that engine reuses its KV;
closing a session sends `EndSession` to the router. The HTTP front
(sessions/http.py) binds to `transport.interface` (loopback unless
configured) and gives each session an OpenAI-compatible base URL, so a
black-box agent using the `openai` client can be trained on exact token ids.
"""

from __future__ import annotations

from typing import Any

from miles.actors.messages import EndSession, Generate
from miles.actors.runtime.actor import Actor, handler
from miles.actors.session_messages import (
    ChatTurn,
    CloseSession,
    CreateSession,
    ExportSamples,
    GetSession,
    ServerInfo,
)
from miles.core.images import ImageInput
from miles.rollout.session_store import SessionStore
from miles.sessions.http import SessionHTTP
from miles.sessions.service import SessionService


class SessionActor(Actor):
    """Serves sessions of `store`; engine calls go to the actor named `router`."""

    def __init__(self, store: SessionStore, router: str = "router", sampling: dict[str, Any] | None = None,
                 return_routed_experts: bool = False, engine_timeout_s: float = 300.0,
                 http_interface: str | None = None, http_port: int = 0, http_advertise: str = "") -> None:
        self.router = router
        self.return_routed_experts = return_routed_experts
        self.engine_timeout_s = engine_timeout_s
        self.service = SessionService(store, self._engine, self._end_session, sampling)
        self._http_interface = http_interface
        self._http_port = http_port
        self._http_advertise = http_advertise
        self.http: SessionHTTP | None = None

    async def on_start(self) -> None:
        # Loopback unless configured: the front speaks plain HTTP with no authentication.
        iface = self._http_interface if self._http_interface is not None else self.host.cfg.interface
        self.http = SessionHTTP(self.service, iface, self._http_port, self._http_advertise)
        await self.http.start()

    async def on_stop(self) -> None:
        if self.http is not None:
            await self.http.stop()

    async def _engine(self, key: str, prompt_ids: list[int], sampling: dict[str, Any],
                      images: ImageInput | None = None) -> dict[str, Any]:
        msg = Generate(prompt_ids, sampling, key, self.return_routed_experts,
                       images=None if images is None else images.to_wire())
        result: dict[str, Any] = await self.ref(self.router).ask(msg, timeout=self.engine_timeout_s)
        return result

    async def _end_session(self, key: str) -> None:
        await self.ref(self.router).ask(EndSession(key), timeout=self.engine_timeout_s)

    def base_url(self, sid: str) -> str:
        return self.http.base_url(sid) if self.http is not None else ""

    # ---------------------------------------------------------------- actor handlers
    @handler(CreateSession, concurrency=64)
    def create(self, msg: CreateSession) -> dict[str, Any]:
        sid = self.service.create(msg.tools, msg.metadata, msg.session_id, msg.routing_key)
        return {"session_id": sid, "base_url": self.base_url(sid)}

    @handler(ChatTurn, concurrency=4096)
    async def chat(self, msg: ChatTurn) -> dict[str, Any]:
        return await self.service.chat(msg.session_id, msg.messages, msg.tools, msg.sampling)

    @handler(GetSession, concurrency=16)
    def info(self, msg: GetSession) -> dict[str, Any]:
        return self.service.info(msg.session_id)

    @handler(ExportSamples, concurrency=64)
    def export(self, msg: ExportSamples) -> list[dict[str, Any]]:
        return [s.to_wire() for s in self.service.export(msg.session_id)]

    @handler(CloseSession, concurrency=64)
    async def close(self, msg: CloseSession) -> None:
        await self.service.close(msg.session_id)

    @handler(ServerInfo, concurrency=4)
    def server_info(self, msg: ServerInfo) -> dict[str, Any]:
        return {"url": self.http.url if self.http is not None else "", **self.service.stats()}
