"""Visual questions about procedurally drawn shapes (the VLM recipe, examples/vlm*.toml).

Each prompt is one small RGB image on a dark background, drawn the way the diffusion recipe
draws its shapes (diffusion/data.py: filled circles, squares and upward triangles compared
against coordinate grids), here in numpy so the rollout process needs no torch, with a
question about it: its colour, which side it is on, or how many shapes there are. The answer
is one word; the reward is the exact answer (rollout/rewards/builtin.py). `turns=2` is the multi-turn
variant: a second image arrives in turn two with its own question, and the reward is the
mean over both answers. Prompt i is a pure function of (seed, i); held-out prompts use
another seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.core.errors import ConfigError
from miles.core.images import ImageInput, patchify
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.rewards.builtin import exact_answer, normalize_answer
from miles.rollout.types import Sample

COLOURS = {"red": (1.0, 0.15, 0.15), "green": (0.15, 1.0, 0.15), "blue": (0.2, 0.3, 1.0), "yellow": (1.0, 1.0, 0.1)}
KINDS = ("colour", "side", "count")
QUESTIONS = {"colour": "colour?", "side": "side?", "count": "count?"}
# the tower's patch layout (the tiny VL preset: models/presets.py)
PATCH, TEMPORAL, MERGE = 4, 2, 2


def draw(rng: random.Random, size: int, n: int, colour: str | None = None,
         side: str | None = None) -> np.ndarray:
    """[size, size, 3] in [0, 1]: `n` filled shapes (circle / square / triangle) that do not
    overlap, of `colour` (else random per shape), all on `side` ('left' / 'right') if given."""
    img = np.zeros((size, size, 3), dtype=np.float32)
    ys, xs = np.meshgrid(np.arange(size) + 0.5, np.arange(size) + 0.5, indexing="ij")
    taken = np.zeros((size, size), dtype=bool)
    placed, tries = 0, 0
    while placed < n and tries < 200:
        tries += 1
        r = size * (0.12 + 0.08 * rng.random()) if n > 1 else size * (0.16 + 0.1 * rng.random())
        lo, hi = r, size - r
        if side == "left":
            hi = size / 2 - 0.5
        elif side == "right":
            lo = size / 2 + 0.5
        if hi <= lo:
            continue
        cx, cy = lo + (hi - lo) * rng.random(), r + (size - 2 * r) * rng.random()
        dx, dy = xs - cx, ys - cy
        kind = rng.randrange(3)
        mask = (dx * dx + dy * dy <= r * r if kind == 0
                else (np.abs(dx) <= r * 0.85) & (np.abs(dy) <= r * 0.85) if kind == 1
                else (dy <= r * 0.8) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6))
        if (mask & taken).any() or not mask.any():
            continue
        taken |= _grow(mask)  # keep a one-pixel gap between shapes, so each stays countable
        img[mask] = COLOURS[colour or rng.choice(sorted(COLOURS))]
        placed += 1
    if placed < n:
        raise ConfigError(f"shapes env: could not place {n} shapes on a {size}x{size} image; raise image_size")
    return img


def _grow(mask: np.ndarray) -> np.ndarray:
    p = np.pad(mask, 1)
    return p[1:-1, 1:-1] | p[:-2, 1:-1] | p[2:, 1:-1] | p[1:-1, :-2] | p[1:-1, 2:]


def question(rng: random.Random, kinds: tuple[str, ...], size: int) -> tuple[ImageInput, str, str]:
    """(the image's patches, the question, the answer)."""
    kind = rng.choice(kinds)
    if kind == "colour":
        answer = rng.choice(sorted(COLOURS))
        img = draw(rng, size, 1, colour=answer)
    elif kind == "side":
        answer = rng.choice(("left", "right"))
        img = draw(rng, size, 1, side=answer)
    else:
        answer = str(rng.randint(1, 3))
        img = draw(rng, size, int(answer))
    return patchify(img, PATCH, TEMPORAL, MERGE), QUESTIONS[kind], answer


def user(img: ImageInput, text: str) -> dict[str, Any]:
    """A user message with the image's JSON form (prompts stay JSON-able: the buffer dumps them)."""
    return {"role": "user", "content": [{"type": "image", "image": img.to_json()}, {"type": "text", "text": text}]}


@dataclass
class ShapePrompts(SeededPrompts):
    env_name = "shapes"

    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    image_size: int = 16
    turns: int = 1
    position: int = 0

    def __post_init__(self) -> None:
        bad = set(self.kinds) - set(KINDS)
        if not self.kinds or bad:
            raise ConfigError(f"shapes env: kinds {list(self.kinds)!r} must be taken from {list(KINDS)}")
        if self.image_size < 8 or self.image_size % (PATCH * MERGE):
            raise ConfigError(f"shapes env: image_size={self.image_size} must be a multiple of {PATCH * MERGE}, >= 8")
        if self.turns not in (1, 2):
            raise ConfigError(f"shapes env: turns={self.turns} must be 1 or 2")

    def item(self, i: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + i)
        img, q, a = question(rng, self.kinds, self.image_size)
        p: Prompt = {"id": f"shapes-{self.seed}-{i}", "index": i, "question": q, "answer": a,
                     "messages": [user(img, q)]}
        if self.turns == 2:
            img2, q2, a2 = question(rng, self.kinds, self.image_size)
            p["second"] = {"message": user(img2, q2), "answer": a2}
        return p


def reward(prompt: Prompt, sample: Sample) -> float:
    """Exact answer; the two-turn variant scores the mean over both turns' answers."""
    answers = sample.metadata.get("answers")
    if answers is None:
        return exact_answer(prompt, sample)
    want = [prompt["answer"], prompt["second"]["answer"]]
    got = [normalize_answer(str(x)) == normalize_answer(str(y)) for x, y in zip(answers, want, strict=False)]
    return sum(got) / len(want)


async def two_turn_agent(ctx: AgentContext) -> dict[str, Any]:
    """Turn one: the first image and question; turn two: the second image and question."""
    first = ctx.prompt["messages"]
    r1 = await ctx.client.chat(ctx.session_id, first, ctx.tools, ctx.sampling)
    a1 = r1["message"].get("content", "")
    if r1["finish_reason"] != "stop":
        return {"answers": [a1], "finish_reason": r1["finish_reason"]}
    r2 = await ctx.client.chat(ctx.session_id, [*first, r1["message"], ctx.prompt["second"]["message"]],
                               ctx.tools, ctx.sampling)
    return {"answers": [a1, r2["message"].get("content", "")], "finish_reason": r2["finish_reason"]}


def make_env(seed: int = 0, kinds: list[str] | None = None, image_size: int = 16, turns: int = 1) -> Environment:
    agent = "miles.rollout.envs.shapes:two_turn_agent" if turns == 2 else "miles.rollout.layers:single_turn_agent"
    return Environment("shapes", ShapePrompts(seed, tuple(kinds or KINDS), image_size, turns), reward, agent)
