"""Per-request logit processors: logit_bias, allowed_token_ids, bad_words and grammar masks.

They run on the leader before temperature and the top-k/top-p masks, so a banned token can
never be sampled and a biased one is biased before truncation (vLLM's order). Each touches only
its own rows, so a request's result never depends on what else shares the batch. Host values go
to the device without a wait (``device_copy``), and no device value is read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gearshift.worker.device_copy import tensor_on, to_device
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.structured.matcher import GrammarMatcher

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class ProcessorRow:
    """What the processors need about one row: its parameters, output so far and grammar."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    grammar: GrammarMatcher | None
    eos_token_ids: frozenset[int]


def apply_processors(work: Tensor, rows: Sequence[ProcessorRow | None]) -> None:
    """Apply each row's processors to `work` [batch, vocab] (fp32) in place; None rows are left."""
    vocab_size = work.shape[1]
    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        logits = work[i]
        device = work.device
        if p.logit_bias:
            ids = tensor_on(list(p.logit_bias), torch.long, device)
            bias = tensor_on(list(p.logit_bias.values()), work.dtype, device)
            logits.index_add_(0, ids, bias)
        if p.allowed_token_ids:
            keep = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            keep[tensor_on(p.allowed_token_ids, torch.long, device)] = True
            logits.masked_fill_(~keep, _NEG_INF)
        banned = bad_word_bans(p.bad_words, row.output_token_ids)
        if banned:
            logits[tensor_on(banned, torch.long, device)] = _NEG_INF
        if row.grammar is not None:
            _apply_grammar(logits, row.grammar, row.eos_token_ids)


def _apply_grammar(logits: Tensor, grammar: GrammarMatcher, eos: frozenset[int]) -> None:
    allowed = to_device(torch.from_numpy(grammar.allowed()), logits.device)
    masked = logits.masked_fill(~allowed, _NEG_INF)
    # Nothing the grammar allows survived the other masks (min_tokens banning EOS after a
    # complete match, say) or the matcher failed: the grammar wins (every allowed token at 0),
    # and with nothing allowed EOS ends the row. Chosen on the device, without reading it.
    eos_ids = sorted(t for t in eos if t < logits.shape[0])
    ends = torch.zeros_like(allowed)
    if eos_ids:
        ends[tensor_on(eos_ids, torch.long, logits.device)] = True
    fallback = torch.where(allowed.any(), allowed, ends)
    zero = logits.new_zeros(())
    rescue = torch.where(fallback, zero, logits.new_full((), _NEG_INF))
    logits.copy_(torch.where(torch.isinf(masked).all(), rescue, masked))


def bad_word_bans(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Token ids to ban now: the last token of each bad word whose other tokens end the output."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (
            not prefix or list(output[len(output) - len(prefix) :]) == list(prefix)
        ):
            banned.append(word[-1])
    return banned
