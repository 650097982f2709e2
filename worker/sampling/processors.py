"""Per-request logit processors: logit_bias, allowed_token_ids, bad_words and grammar masks.

They run on the leader before temperature and the top-k/top-p masks, so a banned token can
never be sampled and a biased one is biased before truncation (vLLM's order). Each touches only
its own rows, so a request's result never depends on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

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
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=work.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=work.dtype, device=work.device)
            logits.index_add_(0, ids, bias)
        if p.allowed_token_ids:
            keep = torch.zeros(vocab_size, dtype=torch.bool, device=work.device)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=work.device)] = True
            logits.masked_fill_(~keep, _NEG_INF)
        banned = bad_word_bans(p.bad_words, row.output_token_ids)
        if banned:
            logits[torch.tensor(banned, dtype=torch.long, device=work.device)] = _NEG_INF
        if row.grammar is not None:
            _apply_grammar(logits, row.grammar, row.eos_token_ids)


def _apply_grammar(logits: Tensor, grammar: GrammarMatcher, eos: frozenset[int]) -> None:
    allowed = torch.from_numpy(grammar.allowed()).to(logits.device)
    masked = logits.masked_fill(~allowed, _NEG_INF)
    if bool(torch.isinf(masked).all()):
        # Nothing the grammar allows survived the other masks (min_tokens banning EOS after a
        # complete match, say) or the matcher failed: the grammar wins, then EOS ends the row.
        masked = torch.full_like(logits, _NEG_INF)
        keep = allowed.nonzero().flatten() if bool(allowed.any()) else None
        if keep is None:
            keep = torch.tensor(sorted(t for t in eos if t < logits.shape[0]), dtype=torch.long)
        masked[keep.to(logits.device)] = 0.0
    logits.copy_(masked)


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
