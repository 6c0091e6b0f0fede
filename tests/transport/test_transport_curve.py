"""CurveZMQ with an authenticator: known clients served, unknown client keys refused, secrets 0600."""

from __future__ import annotations

import os
import stat

import pytest

from miles.actors.runtime.host import Host
from miles.actors.runtime.messages import ListActors
from miles.core.errors import ConfigError, PeerTimeout
from miles.core.schema.transport import TransportConfig
from miles.transport.curve import write_certificate, write_cluster_keys

pytestmark = pytest.mark.timeout(60)


def test_secret_certificates_are_private_from_creation(tmp_path) -> None:
    old = os.umask(0)  # the most permissive umask: the mode must still come out 0600
    try:
        pub, sec = write_certificate(tmp_path / "k", "a")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pub).st_mode) == 0o644
    assert "secret-key" in open(sec).read() and "secret-key" not in open(pub).read()


async def test_known_client_served_unknown_client_refused(tmp_path) -> None:
    keys = write_cluster_keys(tmp_path / "keys", ["head", "worker"])
    server_cfg = TransportConfig(curve_server_key=keys["server"], curve_client_key=keys["head"],
                                 curve_public_key=keys["server_public"], curve_allow_dir=keys["allow"])
    head = Host(server_cfg)  # runs its own directory, behind CURVE
    await head.start()
    from miles.actors.runtime.directory import Directory

    await head.add(Directory(), "directory")
    try:
        worker = Host(TransportConfig(curve_server_key=keys["server"], curve_client_key=keys["worker"],
                                      curve_public_key=keys["server_public"], curve_allow_dir=keys["allow"]),
                      head.address)
        await worker.start()  # subscribes to deaths through the directory: an authenticated ask
        try:
            names = await worker._directory_ask(ListActors(), timeout=5)
            assert names.names == []
        finally:
            await worker.stop()
        # A fresh key pair the server never saw: encrypted, but not authenticated -> refused.
        _, stranger = write_certificate(tmp_path / "other", "stranger")
        intruder = Host(TransportConfig(curve_client_key=stranger, curve_public_key=keys["server_public"]),
                        head.address)
        intruder.directory_addr = head.address
        with pytest.raises(PeerTimeout):
            await intruder._send_ask(head.address, "directory", ListActors(), 1.5)
        # Without CURVE at all: refused too.
        plain = Host(TransportConfig(), head.address)
        with pytest.raises(PeerTimeout):
            await plain._send_ask(head.address, "directory", ListActors(), 1.0)
        for h in (intruder, plain):
            for d in h._dealers.values():
                d.close()
    finally:
        await head.stop()


def test_curve_server_without_allow_list_is_a_config_error(tmp_path) -> None:
    keys = write_cluster_keys(tmp_path / "keys", [])
    import zmq

    from miles.transport.curve import make_curve_server

    s = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ConfigError, match="allow"):
            make_curve_server(s, keys["server"], "")
    finally:
        s.close(0)
