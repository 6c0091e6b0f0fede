"""Image placeholders in the session store: expanded once, where the prompt ids are made.

A user message's image part renders as `IMAGE_MARKER` (rollout/tokens/messages.py), whose
`<|image_pad|>` the tokenizer encodes as one `image_token_id`. Right after a turn's new text is
tokenized, each of those becomes the image's t*h*w / merge^2 tokens (core/images.py); the
expanded ids are what the store keeps, the engine receives and the sample carries, so nothing
downstream expands again. A tokenized placeholder without an image (the text typed it) is
refused, as is an image part whose placeholder the template did not render.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from miles.core.errors import ProtocolError, SessionError
from miles.core.images import ImageInput, expand_placeholders, image_token_counts
from miles.rollout.tokens.messages import Message


def message_images(msgs: Iterable[Message]) -> list[ImageInput]:
    return [img for m in msgs for img in m.get("images", ())]


@dataclass(frozen=True)
class Placeholders:
    image_token_id: int
    merge: int  # the model's spatial_merge_size

    def expand(self, ids: list[int], new: list[Message]) -> list[int]:
        images = message_images(new)
        counts: list[int] = []
        for img in images:
            if img.count != 1:
                raise SessionError(f"an image part holds {img.count} images; give each image its own part")
            counts += image_token_counts(img.grid, self.merge)
        try:
            return expand_placeholders(ids, counts, self.image_token_id)
        except ProtocolError as exc:
            raise SessionError(f"image placeholders: {exc} (does the text type the image token itself, or "
                               "does the chat template drop image parts?)") from None


def turn_images(history: Iterable[Message], new: Iterable[Message]) -> ImageInput | None:
    """Every image of the conversation so far, in order: what the engine needs with the ids."""
    found = message_images(history) + message_images(new)
    return ImageInput.concat(found) if found else None


def placeholders_from_checkpoint(path: str) -> Placeholders | None:
    """The placeholders of the VL model at `path` (its config.json, read without torch), or
    None for a text model or no checkpoint."""
    import json
    from pathlib import Path

    p = Path(path) / "config.json" if path else None
    if p is None or not p.is_file():
        return None
    cfg = json.loads(p.read_text())
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict) or "image_token_id" not in cfg:
        return None
    return Placeholders(int(cfg["image_token_id"]), int(vision.get("spatial_merge_size", 2)))
