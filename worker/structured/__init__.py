"""Structured outputs: grammar specs, and per-sequence matchers that mask the leader's sampler."""

from __future__ import annotations

from gearshift.worker.structured.grammar import (
    GrammarSpec,
    InvalidGrammar,
    compile_grammar,
    spec_from_proto,
    spec_to_proto,
)
from gearshift.worker.structured.matcher import GrammarCompiler, GrammarMatcher

__all__ = [
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarSpec",
    "InvalidGrammar",
    "compile_grammar",
    "spec_from_proto",
    "spec_to_proto",
]
