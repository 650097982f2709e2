"""Pipeline-parallel stages: which layers a stage holds, and how activations and logits cross.

Stages hold contiguous decoder layers (the embedding on the first, the final norm and LM head on
the last), as vLLM and Megatron split them. Rank r of stage s sends its activations to the rank at
the same position in stage s + 1 (gearshift.worker.p2p, gloo on CPU, NCCL on GPU); the last
stage's first rank sends the step's logits to the leader (global rank 0), which samples. Sends are
asynchronous so a stage goes on to its next micro-batch while the transfer completes; they are
waited for, oldest first, before more than ``depth`` are outstanding.

Activations and logits travel on two channels (two process groups, two NCCL communicators). With
two stages the leader sends step k+1's activations to the rank that sends it step k's logits:
on one communicator those opposite directions would queue in posting order on both ranks, the
leader's second send ahead of its receive and the last stage's logits send ahead of its
receive, and deadlock. On two, each pair of ranks has one direction per channel.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, Pending

ACTIVATIONS, LOGITS = "pipeline activations", "pipeline logits"


@dataclass
class PipelineStage:
    """This rank's place in the pipeline: its layers and its peers in the stages around it."""

    index: int
    count: int
    layers: range
    prev_rank: int | None  # global rank sending this rank its activations (None: first stage)
    next_rank: int | None  # global rank receiving them (None: last stage)
    logits_to: int | None  # the leader, when this rank makes the logits and is not the leader
    activations: P2P | None = None  # channel between stages (group rank = global rank)
    logits: P2P | None = None  # channel of the logits to the leader (logits_channel)
    depth: int = 2  # sends that may be outstanding before the oldest is waited for
    _pending: deque[Pending] = field(default_factory=deque, repr=False)

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
        assert self.prev_rank is not None and self.activations is not None
        buf = torch.empty((2, tokens, hidden), dtype=dtype, device=device)
        self.activations.recv(buf, self.prev_rank, ACTIVATIONS).wait()
        return buf[0], buf[1]

    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Both streams in one message; the next stage's first layer adds them in its norm."""
        assert self.next_rank is not None and self.activations is not None
        self._send(self.activations, torch.stack((hidden, residual)), self.next_rank, ACTIVATIONS)

    def send_logits(self, logits: torch.Tensor) -> None:
        assert self.logits_to is not None and self.logits is not None
        self._send(self.logits, logits, self.logits_to, LOGITS)

    def _send(self, channel: P2P, tensor: torch.Tensor, dst: int, label: str) -> None:
        while len(self._pending) >= self.depth:
            self._pending.popleft().wait()
        self._pending.append(channel.send(tensor, dst, label))  # it keeps the tensor alive

    def flush(self) -> None:
        """Wait for every outstanding send (before the group shuts down)."""
        while self._pending:
            self._pending.popleft().wait()

    def close(self) -> None:
        if self.activations is not None:
            self.activations.close()


def logits_channel(world_size: int, rank: int, device: torch.device, timeout: timedelta) -> P2P:
    """The channel the last stage's first rank sends each step's logits to the leader over, on
    a process group of its own (module docstring). Collective: every rank calls it."""
    everyone = tuple(range(world_size))
    pg = dist.new_group(list(everyone), timeout=timeout)
    return P2P(CommGroup(world_size, rank, everyone, pg), LOGITS, device, timeout)


def recv_logits(
    channel: P2P, src: int, rows: int, vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The leader's receive of one step's logits [rows, vocab] from the last stage."""
    buf = torch.empty((rows, vocab), dtype=dtype, device=device)
    channel.recv(buf, src, LOGITS).wait()
    return buf
