"""Engine control messages the weight sync drives: pause and resume around a push, commit or
abort a version, the engines' weight checksums.

Here, not in actors/messages.py, because the sync sends them itself (weightsync/actor_wire.py)
and weightsync/ does not import actors/; actors/messages.py re-exports them for the engine
actor's handlers and `EngineYield`. No torch here: the rollout process imports these.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.transport.schema import message


@message("engine.Pause")
@dataclass
class Pause:
    mode: str = "in_place"


@message("engine.Resume")
@dataclass
class Resume:
    pass


@message("engine.Commit")
@dataclass
class Commit:
    version: int


@message("engine.AbortVersion")
@dataclass
class AbortVersion:
    version: int


@message("engine.Checksums")
@dataclass
class Checksums:
    pass
