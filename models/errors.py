"""Errors of the model package (subclasses of the core hierarchy, so callers can catch MilesError)."""

from __future__ import annotations

from miles.core.errors import MilesError


class CheckpointError(MilesError):
    """A checkpoint does not fit the model: missing, unexpected or mis-shaped tensor (named)."""


class ModelInputError(MilesError, ValueError):
    """A forward call got inputs of the wrong shape, dtype or range (the message names which)."""
