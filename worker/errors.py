"""Typed errors raised at the engine's boundaries.

Each error names what is wrong, so the router maps it to one HTTP/gRPC status and a clear message.
"""

from __future__ import annotations


class GearshiftError(Exception):
    """Base class of every error Gearshift raises on purpose."""


class InvalidRequestError(GearshiftError, ValueError):
    """A request the engine refuses; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class GroupFailure(GearshiftError, RuntimeError):
    """A rank of the worker group died or a collective failed; the group cannot go on."""


class ModelLoadError(GearshiftError):
    """The model could not be found or read; the message names the path or name."""


class UnsupportedModelError(ModelLoadError):
    """The model exists but uses an architecture or option Gearshift does not implement."""
