"""Prompt logprobs (vLLM `prompt_logprobs`): recorded from the extra logits rows a plan asks
for, before the rows that are sampled from reach the sampler.

`build_plan` asks for every row of a prefill chunk while a sequence `needs_prompt_logprobs`;
the row at position q holds the distribution of token q + 1, so a chunk over positions
[start, start + n) scores prompt tokens start + 1 … start + n. A chunk recomputed after a
preemption scores nothing twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gearshift.worker.device_copy import tensor_on
from gearshift.worker.engine.scheduler import ScheduledBatch
from gearshift.worker.sampling.logprobs import compute_logprobs


def take_prompt_logprobs(logits: Tensor, batch: ScheduledBatch) -> Tensor:
    """Record the batch's prompt logprobs; return the rows to sample from, in sampling order.

    Call before the step advances `num_computed_tokens` (the plan was built from it).
    """
    if not any(seq.needs_prompt_logprobs for seq, _ in batch.prefills):
        return logits
    keep = list(range(len(batch.decodes)))
    row = len(batch.decodes)
    for seq, n in batch.prefills:
        start = seq.num_computed_tokens
        completes = start + n == seq.num_tokens
        if not seq.needs_prompt_logprobs:
            if completes:
                keep.append(row)
                row += 1
            continue
        assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
        done = len(seq.prompt_logprobs)
        # Position q scores prompt token q + 1; positions already scored are skipped.
        positions = [q for q in range(start, start + n) if done <= q < seq.num_prompt_tokens - 1]
        if positions:
            rows = tensor_on([row + q - start for q in positions], torch.long, logits.device)
            targets = tensor_on(
                [seq.token_ids[q + 1] for q in positions], torch.long, logits.device
            )
            width = [seq.params.prompt_logprobs] * len(positions)
            scored = compute_logprobs(logits.index_select(0, rows), targets, width)
            seq.prompt_logprobs.extend(lp for lp in scored if lp is not None)
        if completes:
            keep.append(row + n - 1)
        row += n
    return logits.index_select(0, tensor_on(keep, torch.long, logits.device))
