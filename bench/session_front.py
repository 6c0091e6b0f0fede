"""A real session front for the session benches and tests: the rollout process's path, in process.

What `actors/rollout.py` serves with `rollout.http_front` on: `SessionService` + `SessionHTTP`
over `EngineRequests` + `Dispatch`, whose `ActorEngineLink` sends Generate / GenerateMany to
`TorchEngine` actors. Everything runs on one host with a directory, in the caller's event loop;
every engine message still goes through ZeroMQ sockets. The host's death notices take an engine
out of the dispatch, as the rollout actor's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.actors.engine import EngineActor
from miles.actors.engine_link import ActorEngineLink
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.actors.runtime.messages import DeathNotice
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.decoder import CausalLM
from miles.rollout.routing.dispatch import Dispatch
from miles.rollout.routing.requests import EngineRequests
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tokenizer import Tokenizer
from miles.sessions.http import SessionHTTP
from miles.sessions.service import RoutedEngine, SessionService

ENGINE_TIMEOUT_S = 60.0
# what RolloutConfig.sampling() holds, with the engine's own default turn length
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 128}


async def start_host(cfg: TransportConfig | None = None) -> Host:
    """A host running the directory (the head of a small actor system)."""
    cfg = cfg or TransportConfig()
    host = Host(cfg)
    await host.start()
    await host.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    return host


def engine_requests(host: Host, engines: list[str], affinity: bool = True,
                    sampling: dict[str, Any] | None = None, timeout_s: float = ENGINE_TIMEOUT_S) -> EngineRequests:
    """The rollout's request path from `host` to the engine actors named `engines`."""
    reqs = EngineRequests(ActorEngineLink(host.ref, timeout_s), Dispatch(engines, affinity),
                          dict(sampling or SAMPLING), live_wait_s=timeout_s)

    def on_death(notice: DeathNotice) -> None:
        for name in notice.names:
            if name in engines:
                reqs.engine_down(name, f"declared dead: {notice.reason}")

    host.on_death(on_death)
    return reqs


@dataclass
class SessionFront:
    host: Host
    service: SessionService
    http: SessionHTTP
    requests: EngineRequests
    engines: dict[str, TorchEngine]

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def dispatch(self) -> Dispatch:
        return self.requests.dispatch

    async def stop(self) -> None:
        await self.http.stop()
        await self.requests.close()
        await self.host.stop()


async def start_session_front(tok: Tokenizer, models: list[CausalLM], affinity: bool = True,
                              engine_cfg: EngineConfig | None = None, transport: TransportConfig | None = None,
                              token: str = "") -> SessionFront:
    """One engine actor per model (`engine-0`, ...) and the session front over them on loopback."""
    host = await start_host(transport)
    ecfg = engine_cfg or EngineConfig(max_batch_size=8, max_seq_len=1024, kv_budget_tokens=50_000)
    engines: dict[str, TorchEngine] = {}
    for i, model in enumerate(models):
        engines[f"engine-{i}"] = TorchEngine(model, ecfg)
        await host.add(EngineActor(engines[f"engine-{i}"]), f"engine-{i}")
    sampling = {**SAMPLING, "stop_token_ids": list(tok.stop_token_ids)}
    reqs = engine_requests(host, list(engines), affinity, sampling)
    engine = RoutedEngine(reqs)
    service = SessionService(SessionStore(tok), engine, engine.end_session, sampling=sampling)
    http = SessionHTTP(service, "127.0.0.1", token=token)
    await http.start()
    return SessionFront(host, service, http, reqs, engines)
