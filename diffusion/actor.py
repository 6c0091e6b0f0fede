"""The diffusion engine actor: the LLM engine actor (pause, resume, stage, commit, bulk
channels, checksums; actors/engine.py) plus one message, `Denoise`.

A thin shell: the weight-sync coordinator (actors/sync.py) drives it exactly as it drives an
LLM engine; `Denoise` carries a batch of `(condition, seed)` and answers one record per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.actors.engine import EngineActor
from miles.actors.runtime.actor import handler
from miles.core.errors import EngineError
from miles.diffusion.engine import DenoiseRequest, DiffusionEngine
from miles.transport.schema import message


@message("diffusion.Denoise")
@dataclass
class Denoise:
    conditions: list[int]
    seeds: list[int]
    request_ids: list[str]


class DiffusionEngineActor(EngineActor):
    def __init__(self, engine: DiffusionEngine) -> None:
        super().__init__(engine)
        self.diffusion = engine

    @handler(Denoise, concurrency=64)
    async def denoise(self, msg: Denoise) -> list[dict[str, Any]]:
        if not len(msg.conditions) == len(msg.seeds) == len(msg.request_ids):
            raise EngineError(f"Denoise: {len(msg.conditions)} conditions, {len(msg.seeds)} seeds and "
                              f"{len(msg.request_ids)} request ids must be equally many")
        reqs = [DenoiseRequest(c, s, rid) for c, s, rid in zip(msg.conditions, msg.seeds, msg.request_ids, strict=True)]
        return [r.to_wire() for r in await self.diffusion.denoise(reqs)]
