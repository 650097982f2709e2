"""Pipeline-parallel stages: which layers a stage holds, and how activations and logits cross.

Stages hold contiguous decoder layers (the embedding on the first, the final norm and LM head on
the last), as vLLM and Megatron split them. Rank r of stage s sends its activations to the rank at
the same position in stage s + 1 by point-to-point send/recv (gloo on CPU, NCCL on GPU); the last
stage's first rank sends the step's logits to the leader (global rank 0), which samples. Sends are
asynchronous (``isend``) so a stage goes on to its next micro-batch while the transfer completes;
they are waited for, oldest first, before more than ``depth`` are outstanding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.comm import via_host

# Tags keep a step's two messages apart on the same pair of ranks (gloo matches by tag; NCCL
# ignores tags but keeps per-pair order, which is the same order here).
ACTIVATIONS_TAG, LOGITS_TAG = 1, 2


@dataclass
class PipelineStage:
    """This rank's place in the pipeline: its layers and its peers in the stages around it."""

    index: int
    count: int
    layers: range
    prev_rank: int | None  # global rank sending this rank its activations (None: first stage)
    next_rank: int | None  # global rank receiving them (None: last stage)
    logits_to: int | None  # the leader, when this rank makes the logits and is not the leader
    group: Any = None  # the point-to-point process group
    depth: int = 2  # sends that may be outstanding before the oldest is waited for
    _pending: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque, repr=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def recv_activations(
        self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, residual stream) [tokens, hidden] from the previous stage."""
        assert self.prev_rank is not None
        buf = torch.empty((2, tokens, hidden), dtype=dtype, device=_wire(device, self.group))
        dist.recv(buf, src=self.prev_rank, group=self.group, tag=ACTIVATIONS_TAG)
        buf = buf.to(device)
        return buf[0], buf[1]

    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Both streams in one message; the next stage's first layer adds them in its norm."""
        assert self.next_rank is not None
        self._isend(torch.stack((hidden, residual)), self.next_rank, ACTIVATIONS_TAG)

    def send_logits(self, logits: torch.Tensor) -> None:
        assert self.logits_to is not None
        self._isend(logits.contiguous(), self.logits_to, LOGITS_TAG)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        while len(self._pending) >= self.depth:
            self._pending.popleft()[0].wait()
        if via_host(tensor.device, self.group):
            tensor = tensor.cpu()
        work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        self._pending.append((work, tensor))  # the tensor must live until the send completes

    def flush(self) -> None:
        """Wait for every outstanding send (before the group shuts down)."""
        while self._pending:
            self._pending.popleft()[0].wait()


def recv_logits(
    src: int, rows: int, vocab: int, dtype: torch.dtype, device: torch.device, group: Any
) -> torch.Tensor:
    """The leader's receive of one step's logits [rows, vocab] from the last stage."""
    buf = torch.empty((rows, vocab), dtype=dtype, device=_wire(device, group))
    dist.recv(buf, src=src, group=group, tag=LOGITS_TAG)
    return buf.to(device)


def _wire(device: torch.device, group: Any) -> torch.device:
    """Where a receive lands: host memory when gloo carries device tensors (comm.via_host)."""
    return torch.device("cpu") if via_host(device, group) else device
