"""Which engine a rollout request goes to: whole groups on one engine, live engines only.

Routing by group: every request of a trajectory carries its group's routing key, so
the router's affinity pins a GRPO group's n samples (sent together as one
GenerateMany) to one engine, where the engine prefills the shared prompt once
(engine.share_prompts), and each multi-turn session stays where its KV lives. The key
is released when the group ends (or, for an HTTP-front session, when it closes), so
the router's maps hold only the groups in flight. A group whose requests reached more
than one engine while every engine stayed up is counted in `groups_split`; a group
moved off an engine that died is counted in `groups_moved` instead.

Deaths: an engine that died (or whose server is down and restarting) is taken out of
the router, so nothing is routed to it and its load no longer counts; the groups it
held move to the least-loaded live engine. It comes back with `mark_up` once it
answers again. Plain class (no I/O): the rollout orchestrator calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.core.errors import EngineError
from miles.rollout.routing.policy import RouterPolicy


class NoLiveEngine(EngineError):
    """Every engine is down: the request waits for one to come back (bounded by the caller)."""


@dataclass
class DispatchCounters:
    groups_routed: int = 0  # routing keys released after serving at least one request
    groups_split: int = 0  # of those, served by more than one engine with no death in between
    groups_moved: int = 0  # keys moved off an engine that went down
    lost_to_down_engine: int = 0  # requests that failed on a down engine and were routed again
    downs: int = 0
    ups: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # engine -> requests sent


class Dispatch:
    def __init__(self, engines: list[str], affinity: bool = True) -> None:
        self.known = list(engines)
        self.policy = RouterPolicy(engines, affinity)
        self.down: dict[str, str] = {}  # engine -> why it is down
        self.counters = DispatchCounters(requests={e: 0 for e in engines})
        self._served: dict[str, set[str]] = {}  # routing key -> engines that served it

    @property
    def live(self) -> list[str]:
        return self.policy.engines

    def route(self, key: str, prompt_tokens: int) -> str:
        """The live engine for a request of `key`; counts it as in flight there."""
        if not self.policy.engines:
            raise NoLiveEngine(f"every engine is down: {', '.join(f'{e} ({w})' for e, w in self.down.items())}")
        e = self.policy.route(key, prompt_tokens)
        self._served.setdefault(key, set()).add(e)
        self.counters.requests[e] = self.counters.requests.get(e, 0) + 1
        return e

    def finish(self, engine: str, prompt_tokens: int, cached_tokens: int | None = None) -> None:
        self.policy.finish(engine, prompt_tokens, cached_tokens)

    def lost(self, engine: str, prompt_tokens: int) -> None:
        """A request failed because `engine` is down. Call after `mark_down`: the failure then
        does not lower the engine's load (which would make it look least loaded)."""
        self.policy.finish(engine, prompt_tokens)  # a no-op once the engine is out
        self.counters.lost_to_down_engine += 1

    def release(self, key: str) -> None:
        """The group (or session) of `key` ended: forget its engine."""
        served = self._served.pop(key, None)
        self.policy.release(key)
        if served:
            self.counters.groups_routed += 1
            if len(served) > 1:
                self.counters.groups_split += 1

    def mark_down(self, engine: str, why: str) -> bool:
        """Route nothing more to `engine`; True if it was up. Its keys move to live engines."""
        if engine not in self.policy.engines:
            return False
        self.policy.remove_engine(engine)
        for key, served in self._served.items():
            if engine in served:
                self.counters.groups_moved += 1
                # a move forced by a death is not a split: the key's record starts afresh
                now = self.policy.engine_of(key)
                self._served[key] = {now} if now else set()
        self.down[engine] = why
        self.counters.downs += 1
        return True

    def mark_up(self, engine: str) -> bool:
        """`engine` answers again; True if it was down."""
        if engine not in self.down:
            return False
        del self.down[engine]
        self.policy.add_engine(engine)
        self.counters.ups += 1
        return True

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {"rollout/groups_routed": float(c.groups_routed), "rollout/groups_split": float(c.groups_split),
                "rollout/groups_moved": float(c.groups_moved),
                "rollout/requests_lost_to_down_engine": float(c.lost_to_down_engine),
                "rollout/engines_down": float(len(self.down)),
                "rollout/prefix_hit_rate": float(self.policy.prefix_hit_rate)}

    def state(self) -> dict[str, object]:
        c = self.counters
        return {"groups_routed": c.groups_routed, "groups_split": c.groups_split, "groups_moved": c.groups_moved,
                "lost_to_down_engine": c.lost_to_down_engine, "downs": c.downs, "ups": c.ups,
                "requests": dict(c.requests), "down": dict(self.down), "keys_held": len(self._served)}
