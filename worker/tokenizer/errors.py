"""Typed errors of the tokenizer layer; the router maps them to HTTP/gRPC statuses."""

from __future__ import annotations

from pathlib import Path


class TokenizerError(Exception):
    """Base class of every error raised by `gearshift.worker.tokenizer`."""


class TokenizerLoadError(TokenizerError):
    """A tokenizer could not be loaded from `path` (missing, unreadable or unsupported)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load tokenizer from {self.path}: {reason}")


class ChatTemplateError(TokenizerError, ValueError):
    """The chat template is missing, broken, or rejected the messages (a bad request)."""
