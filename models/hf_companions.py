"""The non-weight files of an HF checkpoint, carried from the start model to an exported one.

The trainer exports weights and config.json only; without the tokenizer and chat template the
exported directory cannot be loaded for chat unless the start checkpoint sits beside it. RL does
not change the tokenizer, so the start model's files are the right ones, copied byte for byte.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Every file transformers' tokenizers, processors and generation read from a model directory.
COMPANION_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
    "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
)


def copy_companions(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the companion files src has into dst (which must exist); the names copied."""
    s, d = Path(src), Path(dst)
    copied = []
    for name in COMPANION_FILES:
        if (s / name).is_file():
            shutil.copyfile(s / name, d / name)
            copied.append(name)
    return copied
