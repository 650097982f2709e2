"""What one forward pass needs to know about its batch's attention, derived from a StepPlan."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gearshift.worker.device_copy import tensor_on

# Prefill chunks without history run as one padded attention call while the padded work (chunks x
# longest^2 query-key pairs) stays within both bounds: at most MAX_PADDING_WORK times the real work
# (sum of length^2), and at most the real work plus CALL_WORK per call saved. The second bound
# keeps long chunks apart (their padding costs far more than a call); CALL_WORK is one SDPA call's
# fixed cost on CPU, measured as about the work of attending a 32-token chunk.
MAX_PADDING_WORK = 2.0
CALL_WORK = 32 * 32


@dataclass(frozen=True)
class PaddedPrefill:
    """Prefill chunks without cached history, attended as one right-padded batch.

    Rows of the packed token batch are gathered into [chunks, max_len] (padding rows repeat the
    chunk's last token: finite values that a causal mask keeps away from every real query), and
    the real rows are gathered back out of the padded output.
    """

    chunks: tuple[int, ...]  # indices into the step's prefill chunks, longest first
    max_len: int
    gather: torch.Tensor  # [chunks * max_len] int64: token row of each padded position
    scatter: torch.Tensor  # [tokens of the group] int64: padded position of each token row
    rows: torch.Tensor  # [tokens of the group] int64: the token rows, ascending
    row_range: tuple[int, int] | None  # (start, end) when ``rows`` is one contiguous run
    # True when the chunks are equally long and lie back to back in order: the padded batch is
    # then a view of rows row_range (no gather, no scatter).
    dense: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class PrefillPlan:
    """How a step's prefill chunks are attended: padded batches, and chunks run one by one."""

    batches: tuple[PaddedPrefill, ...]
    singles: tuple[int, ...]  # indices into the prefill chunks


def group_prefills(
    lengths: dict[int, int], max_padding_work: float, call_work: int = CALL_WORK
) -> list[list[int]]:
    """Chunks (index → length) grouped longest first; a chunk joins the current group while the
    group's padded work stays within ``max_padding_work`` x its real work and within its real
    work plus ``call_work`` per call saved (module comment above)."""
    groups: list[list[int]] = []
    work = 0
    for i in sorted(lengths, key=lambda c: -lengths[c]):
        n = lengths[i]
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * lengths[group[0]] ** 2
            real = work + n * n
            if padded <= min(max_padding_work * real, real + len(group) * call_work):
                group.append(i)
                work = real
                continue
        groups.append([i])
        work = n * n
    return groups


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

    @functools.cached_property
    def prefill_plan(self) -> PrefillPlan:
        """Which prefill chunks run as padded batches; built on first use, then shared by every
        layer of the step (cached on this frozen object)."""
        fresh = {
            i: n
            for i, (n, total) in enumerate(
                zip(self.prefill_query_lens, self.prefill_seq_lens, strict=True)
            )
            if n == total
        }
        batches: list[PaddedPrefill] = []
        singles = [i for i in range(self.num_prefills) if i not in fresh]
        for group in group_prefills(fresh, MAX_PADDING_WORK):
            if len(group) == 1:
                singles.append(group[0])
            else:
                batches.append(self._padded(group))
        return PrefillPlan(tuple(batches), tuple(sorted(singles)))

    def _padded(self, group: list[int]) -> PaddedPrefill:
        lens = [self.prefill_query_lens[i] for i in group]
        longest = max(lens)
        gather: list[int] = []
        pairs: list[tuple[int, int]] = []  # (token row, padded position)
        for slot, (i, n) in enumerate(zip(group, lens, strict=True)):
            start = self.prefill_starts[i]
            gather.extend(range(start, start + n))
            gather.extend([start + n - 1] * (longest - n))
            pairs.extend((start + t, slot * longest + t) for t in range(n))
        pairs.sort()
        rows = [r for r, _ in pairs]
        device = self.slot_mapping.device

        def tensor(values: list[int]) -> torch.Tensor:
            return tensor_on(values, torch.int64, device)  # queued: the host does not wait

        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        first = self.prefill_starts[group[0]]
        dense = all(
            n == longest and self.prefill_starts[i] == first + slot * longest
            for slot, (i, n) in enumerate(zip(group, lens, strict=True))
        )
        return PaddedPrefill(
            chunks=tuple(group),
            max_len=longest,
            gather=tensor(gather),
            scatter=tensor([p for _, p in pairs]),
            rows=tensor(rows),
            row_range=(rows[0], rows[-1] + 1) if contiguous else None,
            dense=dense,
        )

    def split(self, rows: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The batch as two micro-batches: token rows [0, rows) and [rows, T), attended one
        after the other (the first writes its KV before the second reads it).

        A prefill chunk that straddles ``rows`` becomes two chunks of one sequence: the second
        attends to the first's tokens as cached history, as chunked prefill does. Batches with
        padding are not split (ValueError), nor at 0 or T."""
        total = self.num_actual_tokens
        if self.num_padding or not 0 < rows < total:
            raise ValueError(f"cannot split {total} tokens (padding {self.num_padding}) at {rows}")
        nd = self.num_decodes
        if rows <= nd:
            first = AttentionMetadata(
                num_decodes=rows,
                slot_mapping=self.slot_mapping[:rows],
                block_tables=self.block_tables[:rows],
                seq_lens=self.seq_lens[:rows],
                max_decode_seq_len=self.max_decode_seq_len,  # a bound: masked past each length
                prefill_starts=(),
                prefill_query_lens=(),
                prefill_seq_lens=(),
            )
            second = AttentionMetadata(
                num_decodes=nd - rows,
                slot_mapping=self.slot_mapping[rows:],
                block_tables=self.block_tables[rows:],
                seq_lens=self.seq_lens[rows:],
                max_decode_seq_len=self.max_decode_seq_len if nd > rows else 0,
                prefill_starts=tuple(s - rows for s in self.prefill_starts),
                prefill_query_lens=self.prefill_query_lens,
                prefill_seq_lens=self.prefill_seq_lens,
            )
            return first, second
        # The chunk holding row ``rows - 1``; ``cut`` of its query rows go to the first half.
        i = max(c for c, s in enumerate(self.prefill_starts) if s < rows)
        start, qlen, seq_len = (
            self.prefill_starts[i],
            self.prefill_query_lens[i],
            self.prefill_seq_lens[i],
        )
        cut = rows - start
        whole = cut == qlen
        first_lens = self.seq_lens[: nd + i + 1]
        if not whole:
            # The first part's context ends at its last query row.
            first_lens = first_lens.clone()
            first_lens[-1] = seq_len - (qlen - cut)
        first = AttentionMetadata(
            num_decodes=nd,
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[: nd + i + 1],
            seq_lens=first_lens,
            max_decode_seq_len=self.max_decode_seq_len,
            prefill_starts=self.prefill_starts[: i + 1],
            prefill_query_lens=(*self.prefill_query_lens[:i], cut),
            prefill_seq_lens=(*self.prefill_seq_lens[:i], seq_len - (qlen - cut)),
        )
        rest = i + 1 if whole else i  # the second half's first chunk
        starts = [rows] if not whole else []
        starts += list(self.prefill_starts[i + 1 :])
        query_lens = [qlen - cut] if not whole else []
        query_lens += list(self.prefill_query_lens[i + 1 :])
        second = AttentionMetadata(
            num_decodes=0,
            slot_mapping=self.slot_mapping[rows:],
            block_tables=self.block_tables[nd + rest :],
            seq_lens=self.seq_lens[nd + rest :],
            max_decode_seq_len=0,
            prefill_starts=tuple(s - rows for s in starts),
            prefill_query_lens=tuple(query_lens),
            prefill_seq_lens=self.prefill_seq_lens[rest:],
        )
        return first, second
