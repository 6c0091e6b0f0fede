"""A SIMULATION of engines' prefix caches, to measure what router affinity buys.

Each simulated engine keeps an LRU set of token prefixes (hashed per page, as a
radix cache would) bounded in tokens. A request hits the longest stored
page-aligned prefix of its prompt; after it runs, the prompt and the sampled
tokens are inserted. This is not an engine; it models only cache reuse.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from miles.rollout.routing.policy import RouterPolicy


class SimPrefixCache:
    def __init__(self, capacity_tokens: int = 1 << 20, page: int = 4) -> None:
        self.capacity = capacity_tokens
        self.page = page
        self._pages: OrderedDict[int, None] = OrderedDict()  # prefix hash per page boundary

    def _hashes(self, ids: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(self.page, len(ids) + 1, self.page):
            h = hash((h, tuple(ids[i - self.page:i])))
            out.append(h)
        return out

    def lookup(self, ids: list[int]) -> int:
        hit = 0
        for k, h in enumerate(self._hashes(ids)):
            if h not in self._pages:
                break
            self._pages.move_to_end(h)
            hit = (k + 1) * self.page
        return hit

    def insert(self, ids: list[int]) -> None:
        for h in self._hashes(ids):
            self._pages[h] = None
            self._pages.move_to_end(h)
        while len(self._pages) * self.page > self.capacity:
            self._pages.popitem(last=False)


@dataclass
class Workload:
    sessions: int = 64
    turns: int = 16
    system_tokens: int = 256  # shared by every session
    user_tokens: int = 12
    response_tokens: int = 96
    concurrency: int = 16  # sessions in flight at once
    seed: int = 0


def simulate_multi_turn(engines: int = 4, affinity: bool = True, wl: Workload | None = None,
                        cache_tokens: int = 1 << 20) -> RouterPolicy:
    """Run the workload through a RouterPolicy over simulated caches; returns the router."""
    wl = wl or Workload()
    rng = random.Random(wl.seed)
    router = RouterPolicy([f"e{i}" for i in range(engines)], affinity=affinity)
    caches = {e: SimPrefixCache(cache_tokens) for e in router.engines}
    system = [rng.randrange(1000) for _ in range(wl.system_tokens)]
    for start in range(0, wl.sessions, wl.concurrency):
        batch = list(range(start, min(start + wl.concurrency, wl.sessions)))
        ctx = {s: list(system) for s in batch}
        for _turn in range(wl.turns):
            order = batch[:]
            rng.shuffle(order)
            running = []
            for s in order:  # all of this round's requests are in flight together
                ctx[s] += [rng.randrange(1000) for _ in range(wl.user_tokens)]
                e = router.route(f"s{s}", len(ctx[s]))
                running.append((s, e, len(ctx[s])))
            for s, e, n in running:
                hit = caches[e].lookup(ctx[s])
                ctx[s] += [rng.randrange(1000) for _ in range(wl.response_tokens)]
                caches[e].insert(ctx[s])
                router.finish(e, n, hit)
        for s in batch:
            router.release(f"s{s}")
    return router
