"""CurveZMQ: certificates in `zmq.auth`'s format, and servers that authenticate their clients.

Encryption alone accepts any client key pair. Every CURVE server here also runs a ZAP
authenticator (`zmq.auth.thread.ThreadAuthenticator`, one per ZeroMQ context) that
accepts only the client public keys found in an allow-list directory (`*.key` files,
as `zmq.auth.load_certificates` reads them). A secret certificate is created with
mode 0600 from the start (never world-readable, not even for an instant).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from miles.core.errors import ConfigError
from miles.core.files import atomic_write_bytes

ZAP_DOMAIN = "miles"
_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, str]] = {}


def write_certificate(key_dir: str | Path, name: str) -> tuple[str, str]:
    """Generate a key pair; write `name.key` (public, 0644) and `name.key_secret` (0600)."""
    d = Path(key_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    head = "#   ZeroMQ CURVE certificate written by miles\n"
    pub_text = f"{head}metadata\ncurve\n    public-key = \"{public.decode()}\"\n"
    sec_text = pub_text + f"    secret-key = \"{secret.decode()}\"\n"
    # created with their mode at open time (never readable by others), moved into place atomically
    atomic_write_bytes(d / f"{name}.key_secret", sec_text.encode(), 0o600)
    atomic_write_bytes(d / f"{name}.key", pub_text.encode(), 0o644)
    return str(d / f"{name}.key"), str(d / f"{name}.key_secret")


def write_cluster_keys(key_dir: str | Path, clients: list[str]) -> dict[str, str]:
    """The launcher's key set: one server certificate and one client certificate per name.

    Returns the paths to set in the transport config: `server` (secret), `server_public`,
    `allow` (the directory of accepted client public keys) and, per client name, its secret.
    """
    d = Path(key_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    server_pub, server_sec = write_certificate(d, "server")
    allow = d / "allowed"
    out = {"server": server_sec, "server_public": server_pub, "allow": str(allow)}
    for name in clients:
        pub, sec = write_certificate(d / "clients", name)
        allow.mkdir(exist_ok=True, mode=0o700)
        os.replace(pub, allow / Path(pub).name)
        out[name] = sec
    return out


def load_certificate(path: str, need_secret: bool) -> tuple[bytes, bytes]:
    if not Path(path).is_file():
        raise ConfigError(f"CurveZMQ certificate {path!r} does not exist")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError as exc:
        raise ConfigError(f"CurveZMQ certificate {path!r}: {exc}") from exc
    if need_secret and not secret:
        raise ConfigError(f"CurveZMQ certificate {path!r} has no secret-key (use the .key_secret file)")
    return public, secret or b""


def _authenticator(ctx: Any, allow_dir: str) -> None:
    """One ZAP handler per context, accepting exactly the public keys in `allow_dir`."""
    if not Path(allow_dir).is_dir():
        raise ConfigError(f"transport.curve_allow_dir {allow_dir!r} is not a directory of client public keys")
    key = ctx.underlying  # the libzmq context: sync and asyncio wrappers of one share a ZAP handler
    with _auth_lock:
        have = _authenticators.get(key)
        if have is not None and have[0].is_alive():
            if have[1] != allow_dir:
                raise ConfigError(f"CurveZMQ: this process already authenticates against {have[1]!r}, "
                                  f"not {allow_dir!r}")
            have[0].configure_curve(domain=ZAP_DOMAIN, location=allow_dir)  # pick up new keys
            return
        # A plain (sync) shadow of the context: the ZAP thread polls with blocking sockets.
        auth = ThreadAuthenticator(zmq.Context.shadow(key))
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=allow_dir)
        _authenticators[key] = (auth, allow_dir)


def make_curve_server(sock: Any, key_file: str, allow_dir: str) -> None:
    """Encrypt and authenticate: only clients whose public key is in `allow_dir` get through."""
    if not allow_dir:
        raise ConfigError("transport.curve_server_key is set but transport.curve_allow_dir is empty: "
                          "CURVE without an allow-list would accept any client key")
    public, secret = load_certificate(key_file, need_secret=True)
    _authenticator(sock.context, allow_dir)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_curve_client(sock: Any, client_key_file: str, server_public_file: str) -> None:
    if not server_public_file:
        raise ConfigError("transport.curve_client_key is set but transport.curve_public_key is empty")
    public, secret = load_certificate(client_key_file, need_secret=True)
    server_public, _ = load_certificate(server_public_file, need_secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def apply_cluster_keys(transport: Any, key_dir: str | Path) -> None:
    """Write a fresh key set under `key_dir` and point a TransportConfig at it (the launcher's part).

    Every process of the run shares the server certificate and one client certificate; a
    process without the key directory (0700, secrets 0600) can neither connect nor listen in.
    """
    keys = write_cluster_keys(key_dir, ["cluster"])
    transport.curve_server_key = keys["server"]
    transport.curve_public_key = keys["server_public"]
    transport.curve_allow_dir = keys["allow"]
    transport.curve_client_key = keys["cluster"]
