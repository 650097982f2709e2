"""The leader's per-step plan (DESIGN.md: leader loop) and how it is built and shipped.

A ``StepPlan`` holds everything a rank needs to run one forward pass: token ids, positions, KV slot
mapping, block tables, sequence lengths, which rows produce logits, which gear runs and which
micro-batch (pipeline slot) it is. Policies add optional *sections*: named int64 vectors such as
KV moves between tiers or ranks, or per-rank token maps (a zig-zag split); a section's wire id is
a hash of its name, so no table outside the policy lists it. The plan packs into a fixed-size
header and one int64 body, so a multi-rank group ships it with two small broadcasts instead of
pickling objects every step, and nothing in it grows with the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.device_copy import to_device
from gearshift.worker.engine.contract import SectionValues
from gearshift.worker.engine.scheduler import ScheduledBatch
from gearshift.worker.kv.block_manager import BlockManager

CORE_SIZE = 9
MAX_SECTIONS = 6
HEADER_SIZE = CORE_SIZE + 1 + 2 * MAX_SECTIONS


def section_id(name: str) -> int:
    """The wire id of a plan section: the same in every process, with no shared table."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class StepPlan:
    """One step's forward-pass inputs: decodes first, then prefill chunks (AttentionMetadata)."""

    step: int
    gear: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W] int64
    seq_lens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [S] int64: token rows whose logits the leader samples from
    num_decodes: int
    prefill_query_lens: tuple[int, ...]
    micro_batch: int = 0  # which of the policy's in-flight slots (pipeline micro-batch) runs it
    sections: Mapping[int, torch.Tensor] = field(default_factory=dict)  # section_id → int64 [n]

    def section(self, name: str) -> torch.Tensor | None:
        """An optional section a policy added (``with_section``), or None."""
        return self.sections.get(section_id(name))

    def with_section(self, name: str, values: SectionValues) -> StepPlan:
        if len(self.sections) >= MAX_SECTIONS and section_id(name) not in self.sections:
            raise ValueError(f"a plan holds at most {MAX_SECTIONS} sections")
        sections = dict(self.sections)
        sections[section_id(name)] = torch.as_tensor(values, dtype=torch.int64).reshape(-1)
        return replace(self, sections=sections)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def attention_metadata(self, seq_lens_host: list[int] | None = None) -> AttentionMetadata:
        """The forward pass's view of this plan; ``seq_lens_host``: ``seq_lens`` as read on the
        host before the plan moved to its device (else it is read here, a wait on a device)."""
        nd = self.num_decodes
        starts: list[int] = []
        pos = nd
        for n in self.prefill_query_lens:
            starts.append(pos)
            pos += n
        if seq_lens_host is None:
            seq_lens_host = self.seq_lens.tolist()
        return AttentionMetadata(
            num_decodes=nd,
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            max_decode_seq_len=max(seq_lens_host[:nd], default=0),
            prefill_starts=tuple(starts),
            prefill_query_lens=self.prefill_query_lens,
            prefill_seq_lens=tuple(seq_lens_host[nd:]),
            num_padding=self.num_tokens - pos,
        )

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, body): the header's fixed size tells receivers how big the body is."""
        t, b = self.num_tokens, self.num_seqs
        w = int(self.block_tables.shape[1]) if b else 0
        s = int(self.logits_indices.shape[0])
        core = [
            self.step,
            self.gear,
            t,
            b,
            w,
            s,
            self.num_decodes,
            len(self.prefill_query_lens),
            self.micro_batch,
        ]
        ids = sorted(self.sections)
        lens = [int(self.sections[i].numel()) for i in ids]
        pairs = [v for i, n in zip(ids, lens, strict=True) for v in (i, n)]
        pad = [0] * (2 * (MAX_SECTIONS - len(ids)))
        header = torch.tensor([*core, len(ids), *pairs, *pad], dtype=torch.int64)
        body = torch.cat(
            [
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.block_tables.reshape(-1),
                self.seq_lens,
                self.logits_indices,
                torch.tensor(self.prefill_query_lens, dtype=torch.int64),
                *(self.sections[i] for i in ids),
            ]
        )
        return header, body

    @staticmethod
    def _layout(header: torch.Tensor) -> tuple[list[int], list[tuple[int, int]]]:
        values = header.tolist()
        core, count = values[:CORE_SIZE], values[CORE_SIZE]
        rest = values[CORE_SIZE + 1 :]
        return core, [(rest[2 * k], rest[2 * k + 1]) for k in range(count)]

    @staticmethod
    def body_size(header: torch.Tensor) -> int:
        core, sections = StepPlan._layout(header)
        _, _, t, b, w, s, _, np_, _ = core
        return 3 * t + b * w + b + s + np_ + sum(n for _, n in sections)

    @classmethod
    def unpack(cls, header: torch.Tensor, body: torch.Tensor) -> StepPlan:
        core, sections = cls._layout(header)
        step, gear, t, b, w, s, nd, np_, mb = core
        parts = torch.split(body, [t, t, t, b * w, b, s, np_, *(n for _, n in sections)])
        return cls(
            step=step,
            gear=gear,
            input_ids=parts[0],
            positions=parts[1],
            slot_mapping=parts[2],
            block_tables=parts[3].view(b, w),
            seq_lens=parts[4],
            logits_indices=parts[5],
            num_decodes=nd,
            prefill_query_lens=tuple(parts[6].tolist()),
            micro_batch=mb,
            sections={sid: parts[7 + k] for k, (sid, _) in enumerate(sections)},
        )

    def to(self, device: torch.device) -> StepPlan:
        if device.type == "cpu":
            return self
        # Plans are built (or received) on the host: queued copies, the host never waits.
        move: dict[str, Any] = {
            k: to_device(getattr(self, k), device)
            for k in (
                "input_ids",
                "positions",
                "slot_mapping",
                "block_tables",
                "seq_lens",
                "logits_indices",
            )
        }
        return replace(self, **move)


def build_plan(
    batch: ScheduledBatch,
    blocks: BlockManager,
    step: int,
    gear: int = 0,
    pad_to: int = 1,
    micro_batch: int = 0,
) -> StepPlan:
    """Turn the scheduler's batch into a plan; ``pad_to`` pads the token count (Ulysses SP)."""
    bs = blocks.block_size
    decodes = batch.decodes
    nd = len(decodes)
    # Decodes: one token each, vectorised over sequences through their block-table rows.
    d_pos = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=nd)
    d_ids = np.fromiter((s.token_ids[-1] for s in decodes), dtype=np.int64, count=nd)
    rows = [s.blocks.row for s in decodes] + [s.blocks.row for s, _ in batch.prefills]
    tables = blocks.tables[rows]
    d_slots = tables[np.arange(nd), d_pos // bs] * bs + d_pos % bs
    ids_parts, pos_parts, slot_parts = [d_ids], [d_pos], [d_slots]
    seq_lens = np.empty(len(rows), dtype=np.int64)
    seq_lens[:nd] = d_pos + 1
    logits_rows = list(range(nd))
    query_lens: list[int] = []
    cursor = nd
    for i, (seq, n) in enumerate(batch.prefills):
        start = seq.num_computed_tokens
        pos = np.arange(start, start + n, dtype=np.int64)
        ids_parts.append(np.asarray(seq.token_ids[start : start + n], dtype=np.int64))
        pos_parts.append(pos)
        slot_parts.append(tables[nd + i, pos // bs] * bs + pos % bs)
        seq_lens[nd + i] = start + n
        query_lens.append(n)
        cursor += n
        if seq.needs_prompt_logprobs:
            # prompt_logprobs: every row of the chunk (engine/prompt_logprobs.py).
            logits_rows.extend(range(cursor - n, cursor))
        elif start + n == seq.num_tokens:
            logits_rows.append(cursor - 1)  # the chunk reaches the end: sample from its last token
    pad = (-cursor) % pad_to
    if pad:
        ids_parts.append(np.zeros(pad, dtype=np.int64))
        pos_parts.append(np.zeros(pad, dtype=np.int64))
        slot_parts.append(np.full(pad, -1, dtype=np.int64))
    width = int(blocks.blocks_needed(int(seq_lens.max()))) if len(rows) else 0
    return StepPlan(
        step=step,
        gear=gear,
        input_ids=torch.from_numpy(np.concatenate(ids_parts)),
        positions=torch.from_numpy(np.concatenate(pos_parts)),
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts)),
        block_tables=torch.from_numpy(np.ascontiguousarray(tables[:, :width])),
        seq_lens=torch.from_numpy(seq_lens),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        num_decodes=nd,
        prefill_query_lens=tuple(query_lens),
        micro_batch=micro_batch,
    )
