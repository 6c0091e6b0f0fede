"""Control messages of the actor runtime itself: directory, heartbeats, deaths."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.transport.schema import message


@message("rt.Register")
@dataclass
class Register:
    name: str
    address: str
    pub_address: str
    host_id: str


@message("rt.Unregister")
@dataclass
class Unregister:
    name: str
    host_id: str


@message("rt.Lookup")
@dataclass
class Lookup:
    name: str
    wait_s: float = 0.0


@message("rt.Location")
@dataclass
class Location:
    name: str
    address: str
    pub_address: str
    host_id: str


@message("rt.Heartbeat")
@dataclass
class Heartbeat:
    host_id: str
    names: list[str]
    loop_lag_ms: float = 0.0


@message("rt.DeathNotice")
@dataclass
class DeathNotice:
    host_id: str
    names: list[str]
    reason: str


@message("rt.ListActors")
@dataclass
class ListActors:
    prefix: str = ""


@message("rt.ActorList")
@dataclass
class ActorList:
    names: list[str] = field(default_factory=list)


@message("rt.Ping")
@dataclass
class Ping:
    payload: bytes = b""


DEATH_TOPIC = "miles.dead"
DIRECTORY_NAME = "directory"  # the directory actor's name (re-exported by host.py)
