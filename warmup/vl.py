"""The supervised warm-up of a vision-language preset (warmup/sft.py): examples with images.

The prompt is rendered and tokenized as the rollout's session store does it (image parts as
the template's marker, each placeholder expanded to its image's tokens:
rollout/tokens/vl_placeholders.py), so the warm-up trains on exactly the ids the engine will be fed. A
two-turn prompt (`second` in the prompt, rollout/envs/shapes.py) gives second-turn examples
too: the first answer is the reference one, then the second image and question.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.core.images import ImageInput
from miles.models.vl_config import VL_TYPES

if TYPE_CHECKING:
    import torch

Example = tuple[list[int], int, ImageInput | None]


def is_vl_arch(arch: str) -> bool:
    from miles.models.config import ARCHITECTURES

    return ARCHITECTURES.get(arch, arch) in VL_TYPES


def vl_examples(env: Any, tok: Any, n: int, rng: random.Random, image_token_id: int, merge: int) -> list[Example]:
    """(ids through the answer's end-of-turn token, index of the first answer token, images)."""
    from miles.rollout.tokens.messages import for_template, normalize
    from miles.rollout.tokens.vl_placeholders import Placeholders, turn_images

    ph = Placeholders(image_token_id, merge)
    out: list[Example] = []
    for _ in range(n):
        p = env.prompts.item(rng.randrange(10**9))
        msgs, answer = list(p["messages"]), str(p["answer"])
        if "second" in p and rng.random() < 0.5:
            msgs = [*msgs, {"role": "assistant", "content": answer}, p["second"]["message"]]
            answer = str(p["second"]["answer"])
        norm = normalize(msgs)
        prompt = tok.apply_chat_template([for_template(m) for m in norm], add_generation_prompt=True)
        full = tok.apply_chat_template([for_template(m) for m in norm] + [{"role": "assistant", "content": answer}])
        ids_p, ids_f = tok.encode(prompt), tok.encode(full)
        if ids_f[: len(ids_p)] != ids_p:
            raise ConfigError("warm-up: the chat template is not append-only for the answer turn")
        end = len(ids_p) + len(tok.encode(answer)) + 1  # through the end-of-turn token
        ids = ph.expand(ids_f[:end], norm)
        out.append((ids, len(ids_p) + len(ids) - end, turn_images([], norm)))
    return out


def vl_logits(model: torch.nn.Module, inp: torch.Tensor, ex: list[Example]) -> torch.Tensor:
    """Logits of right-padded rows [B, T] with every row's images, in row order."""
    import numpy as np
    import torch

    imgs = [im for _, _, im in ex if im is not None]
    if not imgs:
        return model(inp).logits
    pixels = torch.from_numpy(np.concatenate([im.pixels for im in imgs]))
    grid = torch.from_numpy(np.concatenate([im.grid for im in imgs]))
    return model(inp, pixel_values=pixels, image_grid_thw=grid).logits
