"""Whether the megatron backend can run here, and a clear error when it cannot.

megatron-core >= 0.17 needs Python >= 3.12 and hard-wires CUDA (parameters, RNG
tracker, memory buffers), so there is no CPU path: the backend is refused, not faked.
"""

from __future__ import annotations

import importlib.util
import sys

from miles.core.errors import ConfigError


def unavailable_reason() -> str | None:
    """Why the megatron backend cannot run in this process, or None when it can."""
    if sys.version_info < (3, 12):
        return (
            f"megatron-core >= 0.17 needs Python >= 3.12; this is "
            f"{sys.version_info.major}.{sys.version_info.minor}"
        )
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed (pip install 'miles[megatron]')"
    import torch

    if not torch.cuda.is_available():
        return "megatron-core needs a CUDA device and none is visible"
    return None


def require_megatron() -> None:
    """Raise ConfigError naming trainer.backend when megatron-core cannot run here."""
    why = unavailable_reason()
    if why is not None:
        raise ConfigError(f"trainer.backend='megatron' cannot run: {why}; use trainer.backend='fsdp'")


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None
