"""Wire config section: sockets, heartbeats and optional CurveZMQ security."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt


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
