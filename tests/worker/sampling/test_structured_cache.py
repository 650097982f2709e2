"""A structured-output spec is translated and validated once, however many sequences use it."""

from __future__ import annotations

import uuid

import pytest

from gearshift.worker.structured import compile_grammar
from gearshift.worker.structured.grammar import GrammarSpec, InvalidGrammar


def test_the_same_spec_is_compiled_once_and_failures_are_not_remembered() -> None:
    # A property name no other test uses: the cache is process-wide.
    name = uuid.uuid4().hex
    spec = GrammarSpec("json_schema", f'{{"type": "object", "properties": {{"{name}": {{}}}}}}')
    before = compile_grammar.cache_info()
    first = compile_grammar(spec)
    again = compile_grammar(GrammarSpec(spec.kind, spec.value))
    after = compile_grammar.cache_info()
    assert again is first
    assert after.hits == before.hits + 1
    bad = GrammarSpec("regex", "(unclosed")
    for _ in range(2):
        with pytest.raises(InvalidGrammar):
            compile_grammar(bad)
    assert compile_grammar.cache_info().currsize == after.currsize
