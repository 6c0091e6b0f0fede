"""The session server's HTTP front (aiohttp): sessions plus a per-session OpenAI endpoint.

    POST   /sessions                              -> 201 {"session_id", "base_url"}
    GET    /sessions/{id}                         -> the session's summary
    POST   /sessions/{id}/v1/chat/completions     -> OpenAI chat completion (or SSE chunks), logprobs on ask
    POST   /sessions/{id}/v1/generate             -> token ids in, token ids and logprobs out
    POST   /v1/tokenize, /sessions/{id}/v1/tokenize -> {"tokens", "count"} (sessions/token_api.py)
    GET    /sessions/{id}/v1/models               -> the one served model (some clients ask)
    POST   /sessions/{id}/samples                 -> {"session_id", "samples": [Sample as JSON]}
    DELETE /sessions/{id}                         -> {"session_id", "closed": true}
    GET    /health                                -> {"status": "ok", counters...}

Every error is JSON, `{"error": {"message", "type", "code"}}`, with a 4xx status
for bad input (404 unknown session, 409 diverged history, 422 non-append-only
template, 400 anything else malformed, a prompt the engine refuses included) and
5xx only for engine-side failures; no request can take the server down. A session id
given at create must be URL-safe (`rollout/tito/store.py` `check_session_id`), so
the `base_url` returned reaches it.

With a token (`token=`, e.g. read from a 0600 file), every route but /health needs
`Authorization: Bearer <token>` (what OpenAI clients send as their `api_key`);
anything else is answered 401 before its body is read.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from miles.core.errors import (
    ActorDeadError,
    BadRequest,
    ConfigError,
    Diverged,
    EngineError,
    MilesError,
    NotAppendOnly,
    PeerGone,
    PeerTimeout,
    ProtocolError,
    SessionError,
)
from miles.core.logging import get_logger
from miles.sessions.openai_api import (
    check_tools,
    completion,
    completion_chunks,
    parse_chat_request,
    sample_to_json,
)
from miles.sessions.service import SessionService
from miles.sessions.token_api import (
    content_logprobs,
    generate_reply,
    parse_generate_request,
    parse_tokenize_request,
)

log = get_logger("miles.session_http")
MAX_BODY = 64 << 20  # long multi-turn histories with tool outputs exceed aiohttp's 1 MiB default

_STATUS: list[tuple[type[BaseException], int]] = [
    (Diverged, 409), (NotAppendOnly, 422), (SessionError, 400), (ProtocolError, 400), (ConfigError, 400),
    (BadRequest, 400),
    (PeerTimeout, 504), (ActorDeadError, 503), (PeerGone, 503), (EngineError, 502), (MilesError, 500),
]


class NotFound(SessionError):
    """An unknown session id (answered 404)."""


def error_response(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def status_of(exc: BaseException) -> int:
    if isinstance(exc, NotFound):
        return 404
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's own (no such route, wrong method, body too large)
        if exc.status < 400:
            raise
        return error_response(exc.status, type(exc).__name__, f"{request.method} {request.path}: {exc.reason}")
    except MilesError as exc:
        code = status_of(exc)
        if code >= 500:
            log.warning("request_failed", path=request.path, status=code, error=f"{type(exc).__name__}: {exc}")
        kind = "SessionError" if isinstance(exc, NotFound) else type(exc).__name__
        return error_response(code, kind, str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug answers 500 and is logged; the server stays up
        log.error("request_crashed", path=request.path, error=f"{type(exc).__name__}: {exc}")
        return error_response(500, type(exc).__name__, f"internal error: {exc}")


def _bearer(token: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/health":
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, expected):
                return web.json_response(
                    {"error": {"message": "missing or wrong bearer token (Authorization: Bearer ...)",
                               "type": "Unauthorized", "code": 401}},
                    status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def read_token(path: str) -> str:
    """The bearer token in `path` (stripped); a file others can read is refused."""
    import os
    import stat

    if not path:
        return ""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        token = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise ConfigError(f"session HTTP token file {path!r}: {exc}") from exc
    if mode & 0o077:
        raise ConfigError(f"session HTTP token file {path!r} has mode {mode:o}: make it 0600")
    if len(token) < 16:
        raise ConfigError(f"session HTTP token file {path!r}: the token must be at least 16 characters")
    return token


async def _json_body(request: web.Request, optional: bool = False) -> Any:
    try:
        raw = await request.read()
    except RequestPayloadError as exc:  # a body whose Content-Encoding does not decode, a cut-off body
        raise SessionError(f"request body: cannot be read ({str(exc).strip()})") from None
    if not raw.strip():
        if optional:
            return {}
        raise SessionError("request body: empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SessionError(f"request body: not valid JSON ({exc})") from exc
    except RecursionError:
        raise SessionError("request body: JSON nested too deep") from None


class SessionHTTP:
    """Serves a `SessionService` over HTTP on `interface:port` (port 0 = any free port)."""

    def __init__(self, service: SessionService, interface: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", token: str = "") -> None:
        self.service = service
        self.token = token
        self.interface = interface
        self.port = port
        self.advertise = advertise
        self.url = ""
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        middlewares = [_bearer(self.token), _errors] if self.token else [_errors]
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_post("/sessions", self.create)
        app.router.add_get("/sessions/{sid}", self.info)
        app.router.add_delete("/sessions/{sid}", self.close)
        app.router.add_post("/sessions/{sid}/samples", self.samples)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self.chat)
        app.router.add_get("/sessions/{sid}/v1/models", self.models)
        app.router.add_post("/sessions/{sid}/v1/generate", self.generate)
        app.router.add_post("/sessions/{sid}/v1/tokenize", self.tokenize)
        app.router.add_post("/v1/tokenize", self.tokenize)
        return app

    async def start(self) -> str:
        """Bind and serve; returns the root URL (e.g. http://127.0.0.1:PORT)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.interface, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.advertise or self.interface
        if host in ("0.0.0.0", "::", ""):
            import socket

            host = socket.gethostname()
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("session_http_ready", url=self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def _sid(self, request: web.Request) -> str:
        sid = request.match_info["sid"]
        if not self.service.exists(sid):
            raise NotFound(f"unknown session {sid!r} (closed, never created, or created on another server)")
        return sid

    # ---------------------------------------------------------------- handlers
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.service.stats()})

    async def create(self, request: web.Request) -> web.Response:
        body = await _json_body(request, optional=True)
        if not isinstance(body, dict):
            raise SessionError(f"request body: expected a JSON object, got {type(body).__name__}")
        unknown = set(body) - {"tools", "metadata", "session_id", "routing_key"}
        if unknown:
            raise SessionError(f"unknown field(s) {sorted(unknown)}; valid: metadata, routing_key, session_id, tools")
        tools = check_tools(body.get("tools"))
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise SessionError(f"metadata: expected an object, got {type(meta).__name__}")
        for key in ("session_id", "routing_key"):
            if not isinstance(body.get(key, ""), str):
                raise SessionError(f"{key}: expected a string, got {body[key]!r}")
        sid = self.service.create(tools, meta, body.get("session_id", ""), body.get("routing_key", ""))
        return web.json_response({"session_id": sid, "base_url": self.base_url(sid)}, status=201)

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.info(self._sid(request)))

    async def close(self, request: web.Request) -> web.Response:
        sid = self._sid(request)
        await self.service.close(sid)
        return web.json_response({"session_id": sid, "closed": True})

    async def samples(self, request: web.Request) -> web.Response:
        sid = self._sid(request)
        return web.json_response({"session_id": sid,
                                  "samples": [sample_to_json(s) for s in self.service.export(sid)]})

    async def models(self, request: web.Request) -> web.Response:
        self._sid(request)
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model",
                                                              "created": 0, "owned_by": "miles"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sid = self._sid(request)
        req = parse_chat_request(await _json_body(request))
        turn = await self.service.chat(sid, req.messages, req.tools, req.sampling)
        lps = content_logprobs(self.service.store.tok, turn["output_ids"], turn["logprobs"]) if req.logprobs else None
        if not req.stream:
            return web.json_response(completion(turn, req.model, lps))
        # The engine returns a turn whole; it still goes out as SSE chunks for streaming clients.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in completion_chunks(turn, req.model, req.include_usage, lps):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(self, request: web.Request) -> web.Response:
        sid = self._sid(request)
        req = parse_generate_request(await _json_body(request))
        out = await self.service.generate(sid, req.input_ids, req.sampling)
        return web.json_response(generate_reply(out, len(req.input_ids)))

    async def tokenize(self, request: web.Request) -> web.Response:
        if "sid" in request.match_info:
            self._sid(request)
        req = parse_tokenize_request(await _json_body(request))
        ids = self.service.tokenize(req.messages, req.tools, req.prompt)
        return web.json_response({"tokens": ids, "count": len(ids)})
