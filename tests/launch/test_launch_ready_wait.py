"""engine.ready_wait_s: the wait of the rollout process and the trainer for the roles they need at start."""

from __future__ import annotations

import asyncio

import pytest

from miles.actors.runtime.actor import Actor
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.config import load_config
from miles.core.errors import ConfigError, PeerTimeout
from miles.core.schema import MilesConfig
from miles.core.schema.transport import TransportConfig
from miles.launch.role import _wait_for

pytestmark = pytest.mark.timeout(60)


class Idle(Actor):
    """An actor that only registers (stands for an engine that has warmed up)."""


@pytest.mark.parametrize(("sets", "match"), [
    (["engine.ready_wait_s=0"], "must be > 0"),
    (["engine.type=sglang", "engine.sglang_model_path=/m", "engine.ready_wait_s=600"],
     "must exceed engine.sglang_startup_timeout_s=600"),
])
def test_a_wait_that_cannot_work_is_refused(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(MilesConfig, None, sets)


def test_the_default_outlasts_a_launched_servers_start() -> None:
    cfg = load_config(MilesConfig, None, ["engine.type=sglang", "engine.sglang_model_path=/m"])
    assert cfg.engine.ready_wait_s > cfg.engine.sglang_startup_timeout_s
    # an already running server (sglang_url) has no start to wait for: any positive wait
    load_config(MilesConfig, None, ["engine.type=sglang", "engine.sglang_url=http://h:1", "engine.ready_wait_s=5"])


async def test_wait_returns_once_registered_and_a_missing_role_names_the_option() -> None:
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    head = Host(cfg)
    await head.start()
    await head.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    client = Host(cfg, directory=head.address)
    await client.start()
    try:
        waiting = asyncio.create_task(_wait_for(client, ["engine-0", "engine-1"], 30.0))
        await head.add(Idle(), "engine-1")
        await asyncio.sleep(0.1)  # fixed on purpose: a window in which the wait may not return
        assert not waiting.done()  # engine-0 has not registered yet
        await head.add(Idle(), "engine-0")
        await waiting
        with pytest.raises(PeerTimeout, match=r"'engine-2'.*engine\.ready_wait_s=0\.5"):
            await _wait_for(client, ["engine-0", "engine-2"], 0.5)
    finally:
        await client.stop()
        await head.stop()
