"""A multi-turn token workload for measuring the router's prefix-cache hit rate on real engines.

Sessions run in lock-step rounds: each round every session sends its whole
history plus a few new "user" tokens, all rounds' requests in flight together in
a shuffled order (so, with affinity off, least-loaded placement scatters a
session's turns across engines). The engine's sampled tokens join the history
as they are. Used by the router tests and bench/session.py.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from miles.actors.messages import EndSession, Generate
from miles.actors.runtime.ref import ActorRef


@dataclass
class MultiTurnWorkload:
    sessions: int = 6
    turns: int = 16
    system_tokens: int = 16
    user_tokens: int = 2
    response_tokens: int = 32
    vocab: int = 100  # token ids are drawn from [1, vocab)
    seed: int = 0


@dataclass
class WorkloadResult:
    requests: list[dict[str, Any]]  # per request: session, turn, engine, prompt_tokens, cached_tokens

    @property
    def prefix_hit_rate(self) -> float:
        p = sum(r["prompt_tokens"] for r in self.requests)
        return sum(r["cached_tokens"] for r in self.requests) / p if p else 0.0

    def engines_of(self, session: int) -> list[str]:
        return [r["engine"] for r in sorted(self.requests, key=lambda r: r["turn"]) if r["session"] == session]


async def run_multi_turn(router: ActorRef, wl: MultiTurnWorkload, key_prefix: str = "wl",
                         timeout: float = 120.0) -> WorkloadResult:
    rng = random.Random(wl.seed)
    ctx = {s: [rng.randrange(1, wl.vocab) for _ in range(wl.system_tokens)] for s in range(wl.sessions)}
    out: list[dict[str, Any]] = []

    async def turn(s: int, t: int) -> None:
        sampling = {"temperature": 1.0, "max_new_tokens": wl.response_tokens, "stop_token_ids": [],
                    "seed": wl.seed * 1_000_003 + s * 1009 + t}
        r = await router.ask(Generate(list(ctx[s]), sampling, f"{key_prefix}-{s}"), timeout=timeout)
        ctx[s] += r["output_ids"]
        out.append({"session": s, "turn": t, "engine": r["engine"], "prompt_tokens": r["prompt_tokens"],
                    "cached_tokens": r["cached_tokens"]})

    for t in range(wl.turns):
        order = list(range(wl.sessions))
        rng.shuffle(order)
        for s in order:
            ctx[s] += [rng.randrange(1, wl.vocab) for _ in range(wl.user_tokens)]
        await asyncio.gather(*(turn(s, t) for s in order))
    for s in range(wl.sessions):
        await router.ask(EndSession(f"{key_prefix}-{s}"), timeout=timeout)
    return WorkloadResult(out)
