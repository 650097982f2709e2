"""Streaming detokenisation: turn each step's new token ids into exactly the newly finished text."""

from __future__ import annotations

from collections.abc import Sequence

from gearshift.worker.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token. A few are enough for a
# SentencePiece "▁word" to keep its space and for a character split across the prompt boundary.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing token sequence through a small sliding window (vLLM's offsets scheme).

    Each step decodes only a window: the tokens emitted last (the prefix, whose text is known)
    plus the tokens not yet emitted, and returns the text past the prefix's. Text ending in
    U+FFFD is held back, since it may be an incomplete UTF-8 character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        prompt = list(prompt_token_ids)
        start = min(self._last_visible(prompt), max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0))
        # Only the window is kept, so memory and per-step work do not grow with the output.
        self._ids: list[int] = prompt[start:]
        self._read_offset = len(self._ids)  # ids[:read_offset] is the window's prefix
        self._prefix_text = self._decode(self._ids)
        self._num_output_tokens = 0

    @property
    def num_output_tokens(self) -> int:
        """How many output token ids have been fed so far."""
        return self._num_output_tokens

    def _last_visible(self, ids: Sequence[int]) -> int:
        """Index of the last token of `ids` that reaches the decoder (not a skipped special).

        A window whose prefix is only skipped special tokens would let SentencePiece decoders
        strip the leading space of the next word as if it began the text.
        """
        for index in range(len(ids) - 1, -1, -1):
            if ids[index] not in self._skipped:
                return index
        return 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append `new_token_ids`; return the text they complete ("" while a char is partial)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            # Nothing new yet, or the tail may be a partial character: wait for more tokens.
            return ""
        # The window's prefix decodes the same inside the longer window (it ended on a complete
        # character), so the new text is what lies past it.
        delta = text[len(self._prefix_text) :]
        self._advance()
        return delta

    def flush(self) -> str:
        """Text still held back at the end of generation (a trailing U+FFFD, as `decode` shows)."""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance()
        return delta

    def _advance(self) -> None:
        # The tokens just emitted become the next window's prefix; older ones are dropped. They
        # made text, so at least one of them reaches the decoder (see _last_visible).
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
