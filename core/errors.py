"""The one error hierarchy of miles (see ARCHITECTURE.md, "Errors").

Every error that crosses an actor boundary is re-raised on the caller's side as
the same class when it is known here, else as `RemoteError` carrying the remote
type name, message and traceback.
"""

from __future__ import annotations


class MilesError(Exception):
    """Base of every error miles raises on purpose."""

    remote_traceback: str  # set when raised in another process's handler (actors/runtime/host.py)


class ConfigError(MilesError):
    """A config file, override or hook is wrong; the message names the dotted path."""


class StartupError(MilesError):
    """A role cannot start, and would fail the same way on every try (missing weights, a missing
    package, a refused config, an external server that will not come up): its supervisor does
    not restart it (launch/supervision.py)."""


class ProtocolError(MilesError):
    """A wire message is malformed: bad frame, schema, type or size."""


class TransportError(MilesError):
    """A socket or bulk channel failed."""


class PeerTimeout(TransportError):
    """A peer did not answer before the request's deadline."""


class MailboxFull(TransportError):
    """The target handler's bounded mailbox is full and its policy is to refuse, not to wait."""


class Stopping(TransportError):
    """A send on a socket this process already closed: it is shutting down (SIGINT/SIGTERM), so
    the call is not a failure of the peer; shutdown paths log it as such, not as an error."""


class PeerGone(TransportError):
    """A peer closed its connection or disappeared."""


class ActorDeadError(MilesError):
    """The target actor missed its heartbeats and is declared dead."""


class RemoteError(MilesError):
    """An error raised inside a remote handler, with the remote type and traceback."""

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = traceback


class EngineError(MilesError):
    """A rollout engine rejected a request or crashed."""


class EngineStartError(EngineError, StartupError):
    """An engine's server could not start (it exited or never answered during start-up), or could
    not be started again: the same config fails the same way, so neither the engine nor its
    supervisor restarts it; the message ends with the server's own error lines."""


class EngineDown(EngineError):
    """The engine's server is down (crashed, restarting): the request never ran, through no fault
    of its prompt; route it elsewhere or retry once the engine's health says ok again."""


class BadRequest(EngineError):
    """An engine refuses a request for what it asks (an empty prompt or one that leaves no room under
    max_seq_len, ids outside the vocabulary, bad sampling values): the caller's mistake, answered
    4xx at the session front; the same request fails the same way on any engine."""


class SessionError(MilesError):
    """A session-server request cannot be served."""


class Diverged(SessionError):
    """A linear session got a history that diverges from the stored one."""


class NotAppendOnly(SessionError):
    """A chat template re-renders earlier turns, so suffix tokenization would be wrong."""


class TrainerError(MilesError):
    """The trainer got a batch or state it cannot train on."""


class RewardError(MilesError):
    """A reward function raised or returned a non-number; the message names the prompt and the cause."""


class SyncError(MilesError):
    """A weight-sync step failed or timed out; the message names the step and the peer."""


class PlanMissing(SyncError):
    """An engine got bytes of a flat plan it does not hold: it restarted since the plan was sent.
    The push goes on without it (as for a dead engine) and the trainer catches it up."""


# Name -> class, so a RemoteError from a peer can be re-raised as the real type.
KNOWN_ERRORS: dict[str, type[MilesError]] = {
    cls.__name__: cls
    for cls in (
        MilesError,
        ConfigError,
        ProtocolError,
        TransportError,
        Stopping,
        PeerTimeout,
        MailboxFull,
        PeerGone,
        ActorDeadError,
        EngineError,
        EngineStartError,
        EngineDown,
        BadRequest,
        SessionError,
        Diverged,
        NotAppendOnly,
        TrainerError,
        SyncError,
        PlanMissing,
        RewardError,
    )
}


def remote_exception(type_name: str, message: str, traceback: str = "") -> MilesError:
    """The exception a peer's error (its class name, message and traceback) is raised as here:
    the same class where both sides know it, so callers catch it by type; else a RemoteError."""
    cls = KNOWN_ERRORS.get(type_name)
    if cls is not None and cls is not RemoteError:
        exc = cls(message)
        exc.remote_traceback = traceback
        return exc
    return RemoteError(type_name, message, traceback)
