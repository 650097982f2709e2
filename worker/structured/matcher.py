"""Per-sequence grammar matchers on the leader: the allowed-token bitmask, and token acceptance."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from gearshift.worker.structured.grammar import GrammarSpec, InvalidGrammar, compile_grammar
from gearshift.worker.tokenizer import Tokenizer


class GrammarMatcher:
    """Where one sequence is in its grammar; `bitmask()` says which tokens may come next."""

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """Bool [vocab_size]: the tokens that keep the output inside the grammar.

        A matcher in error (it can only get there through a token it did not allow) allows
        nothing; the sampler then ends the sequence instead of sampling at random.
        """
        if self._matcher.is_error():
            return np.zeros(self.vocab_size, dtype=bool)
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, bits.shape[0])
        out[:n] = bits[:n]
        return out

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar did not allow it."""
        if self._matcher.is_stopped():
            return True  # EOS after a complete match: nothing left to check
        return bool(self._matcher.consume_token(token_id))

    @property
    def error(self) -> str:
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""


@dataclass
class GrammarCompiler:
    """Builds matchers for one engine's tokenizer; the llguidance tokenizer is made once, lazily.

    Building it walks the whole vocabulary (about half a second for 49K tokens), so engines
    that never see a structured request never pay for it.
    """

    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: Iterable[int]
    _ll: LLTokenizer | None = field(default=None, init=False, repr=False)

    def _ll_tokenizer(self) -> LLTokenizer:
        if self._ll is None:
            eos = sorted(self.eos_token_ids) or None
            # The model's vocabulary may be padded past the tokenizer's; masks span the logits.
            n_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
            self._ll = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return self._ll

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one sequence; raises InvalidGrammar when `spec` does not compile."""
        grammar = compile_grammar(spec)
        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(matcher.get_error())
        return GrammarMatcher(matcher, self.vocab_size)
