"""Tokenisation, streaming detokenisation, stop strings. No torch here: the router imports this."""

from __future__ import annotations

from gearshift.worker.tokenizer.chat_template import ChatTemplate
from gearshift.worker.tokenizer.detokenizer import IncrementalDetokenizer
from gearshift.worker.tokenizer.errors import ChatTemplateError, TokenizerError, TokenizerLoadError
from gearshift.worker.tokenizer.stop import StopChecker, StopResult
from gearshift.worker.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopChecker",
    "StopResult",
    "Tokenizer",
    "TokenizerError",
    "TokenizerLoadError",
]
