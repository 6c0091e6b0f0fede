"""Wire config section: sockets, heartbeats and optional CurveZMQ security."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt, section
from miles.core.errors import ConfigError


@dataclass
class FaultConfig:
    """Fault injection for soak and chaos tests (transport/faults.py); all off by default."""

    drop_rate: float = opt(0.0, "fraction of outgoing actor messages dropped (never sent), among the "
                           "types in drop_types; tests only, 0 = off", "fraction")
    drop_types: list[str] = opt([], "wire names of the message types that may be dropped (e.g. "
                                "engine.Generate; a reply counts as its request's type); empty = every type", "")
    delay_rate: float = opt(0.0, "fraction of outgoing actor messages (any type) delayed before "
                            "sending; tests only, 0 = off", "fraction")
    delay_ms: float = opt(0.0, "largest injected delay; a delayed message waits uniform(0, delay_ms)", "ms")
    seed: int = opt(0, "seed of the fault draws (mixed with the process id: each process its own stream)", "")
    drop_limit: int = opt(0, "most messages one process drops, then it drops no more; 0 = no limit. With "
                          "drop_rate 1 each process drops exactly its first N messages of drop_types: a loss "
                          "that a test can count on, where a rate leaves which ones to the draw", "messages")

    def __post_init__(self) -> None:
        for name in ("drop_rate", "delay_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"transport.faults.{name}={v} must be in [0, 1]")
        if self.delay_ms < 0:
            raise ConfigError(f"transport.faults.delay_ms={self.delay_ms} must be >= 0")
        if self.drop_limit < 0:
            raise ConfigError(f"transport.faults.drop_limit={self.drop_limit} must be >= 0 (0 = no limit)")


@dataclass
class TransportConfig:
    scheme: Literal["tcp", "ipc"] = opt("tcp", "address scheme actors bind to")
    interface: str = opt("127.0.0.1", "interface to bind tcp sockets on; loopback unless set")
    ipc_dir: str = opt("", "directory for ipc:// sockets; empty = a private temp dir", "path")
    hwm: int = opt(10000, "ZeroMQ send high-water mark per peer (receive side: mailbox_size)", "messages")
    linger_ms: int = opt(0, "how long a closing socket keeps unsent messages", "ms")
    heartbeat_interval_s: float = opt(0.5, "how often actors send heartbeats to the directory", "s")
    heartbeat_timeout_s: float = opt(3.0, "silence after which a peer is declared dead", "s")
    loop_stall_timeout_s: float = opt(60.0, "heartbeats come from a thread; a process whose event loop has "
                                      "not ticked for this long stops them (a hung loop is dead)", "s")
    default_deadline_s: float = opt(30.0, "deadline of a request when the caller gives none", "s")
    mailbox_size: int = opt(1024, "bound of each handler's mailbox, of a host's read-ahead and of "
                            "ZeroMQ's receive queue per peer; full = block or refuse (per handler)", "messages")
    max_frame_bytes: int = opt(4 << 30, "largest frame accepted from the wire (ZeroMQ MAXMSGSIZE: a "
                               "larger one drops the connection before it is read)", "bytes")
    curve_server_key: str = opt("", "CurveZMQ server secret certificate (zmq.auth .key_secret); empty = "
                                "no encryption", "path")
    curve_client_key: str = opt("", "CurveZMQ client secret certificate of this process", "path")
    curve_public_key: str = opt("", "CurveZMQ server public certificate (clients)", "path")
    curve_allow_dir: str = opt("", "directory of accepted client public certificates (*.key); required "
                               "with curve_server_key: any other client key is refused", "path")
    curve: bool = opt(False, "the launcher writes a fresh key set under <run.dir>/keys (0600) and fills "
                      "the four curve_* paths", "")
    faults: FaultConfig = section(FaultConfig, "fault injection (drop, delay) for soak and chaos tests; off by default")
