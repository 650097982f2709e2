"""What one forward pass needs to know about its batch's attention, derived from a StepPlan."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """A batch of sequences laid out decodes first, then prefill chunks, then padding.

    ``seq_lens`` counts every token of a sequence's context including this step's new tokens.
    Padding tokens (``slot_mapping`` == -1) write no KV and get a zero output.
    """

    num_decodes: int
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    max_decode_seq_len: int
    # Prefill chunks as host lists: few per step, and looping over them needs no device sync.
    prefill_starts: tuple[int, ...]
    prefill_query_lens: tuple[int, ...]
    prefill_seq_lens: tuple[int, ...]
    num_padding: int = 0

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_starts)

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_actual_tokens(self) -> int:
        return self.num_decodes + sum(self.prefill_query_lens)
