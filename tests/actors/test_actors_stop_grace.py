"""A host's stop bounds each actor's on_stop by its grace, and says so when one runs out (an SGLang
engine's server can take longer to exit than the grace: the line named nothing, as str() of a
TimeoutError is empty)."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from miles.actors.runtime.actor import Actor
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.errors import EngineError
from miles.core.schema.transport import TransportConfig

pytestmark = pytest.mark.timeout(30)


class SlowStop(Actor):
    async def on_stop(self) -> None:
        await asyncio.sleep(60)


class FailingStop(Actor):
    async def on_stop(self) -> None:
        raise EngineError("server did not answer /shutdown")


async def test_an_on_stop_past_the_grace_is_named_and_the_host_still_stops() -> None:
    cfg = TransportConfig()
    host = Host(cfg)  # its own directory: no other process needed
    await host.start()
    await host.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    await host.add(SlowStop(), "slow")
    await host.add(FailingStop(), "failing")
    with capture_logs() as logs:
        await asyncio.wait_for(host.stop(grace_s=0.5), 10)
    errors = {e["actor"]: e["error"] for e in logs if e["event"] == "on_stop_failed"}
    assert errors["slow"].startswith("on_stop did not finish within") and "0.5 s stop grace" in errors["slow"]
    assert errors["failing"] == "EngineError: server did not answer /shutdown"
