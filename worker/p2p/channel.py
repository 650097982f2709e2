"""Point-to-point traffic between the ranks of one process group, under NCCL's contract on every
backend (DESIGN.md, GPU path):

- no tags: for each ordered pair of ranks, the k-th send matches the k-th receive;
- opposite-direction traffic between two peers that must progress together is one batched
  exchange (``exchange``: ``torch.distributed.batch_isend_irecv``, an NCCL group on GPUs);
- a dead peer is an error within a bound: gloo fails the operation at once; on NCCL the group's
  timeout and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (launch/rank.py) abort it.

A ``P2P`` channel owns one process group's point-to-point traffic (one channel per group: NCCL
keeps one FIFO per pair of ranks and communicator, so two channels over one group would share
it). Its construction is collective over the group, so the communicator exists before any batch
(torch: a batch that is a group's first operation must involve all of its ranks). Peers are group
ranks. Every message has a label saying what it is, which the NCCL rules check on receipt
(``GEARSHIFT_COMM_RULES=nccl``: headers, ``checked.py``).

gloo moves CPU tensors only: device tensors cross it through host memory (comm.via_host); NCCL
takes them as they are.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gearshift.worker.comm import CommGroup, via_host
from gearshift.worker.p2p.checked import Incoming, PeerReceiver, first_line
from gearshift.worker.p2p.header import Header, describe
from gearshift.worker.p2p.rules import COMM_RULES_ENV, CommRules, RuleViolation, comm_rules

# Hidden tags of the NCCL-rules mode on gloo: headers and payloads in FIFOs of their own.
HEADER_TAG, PAYLOAD_TAG = 0x4753, 0x4754

# NCCL keeps one FIFO per pair and communicator: one channel per process group, process-wide.
# Closed channels leave it; a destroyed group's name may come back (the default group is always
# "0"), so the entry holds the group weakly and a new group of that name replaces a dead one.
_open_groups: dict[str, weakref.ref[Any]] = {}
_open_lock = threading.Lock()


@dataclass(frozen=True)
class Send:
    """One send of an exchange: ``tensor`` to group rank ``peer``, labelled with what it is."""

    peer: int  # group rank
    tensor: torch.Tensor
    label: str


@dataclass(frozen=True)
class Recv:
    """One receive of an exchange: into ``buffer`` from group rank ``peer``, expecting ``label``."""

    peer: int  # group rank
    buffer: torch.Tensor  # filled in place
    label: str


@dataclass
class _Op:
    send: bool
    peer: int
    label: str
    what: str  # for errors: "'label' float32[2, 3]"
    works: list[Any] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # live until the op is done
    finish: Callable[[], Any] | None = None  # a staged receive: copy into the buffer
    incoming: Incoming | None = None


@dataclass
class _Call:
    """One torch point-to-point call of a message (``peer``: a group rank)."""

    op: Any  # the _Op it belongs to
    fn: Any  # distributed_c10d.isend or .irecv (unguarded: rules.py)
    tensor: torch.Tensor
    peer: int
    tag: int

    def post(self, pg: Any) -> Any:
        peer = "group_dst" if self.fn is c10d.isend else "group_src"
        return self.fn(self.tensor, group=pg, tag=self.tag, **{peer: self.peer})

    def p2p_op(self, pg: Any) -> Any:
        return c10d.P2POp(self.fn, self.tensor, group=pg, tag=self.tag, group_peer=self.peer)


class Pending:
    """Posted operations (one, or one batch); ``wait`` until done."""

    def __init__(self, channel: P2P, ops: list[_Op], grouped: bool) -> None:
        self.channel, self.ops, self.grouped = channel, ops, grouped
        self.waited = False

    def done(self) -> bool:
        """Every operation has completed, or failed (``wait`` then raises)."""
        ok = all(_op_done(op) for op in self.ops)
        if ok and all(op.finish is None and op.incoming is None for op in self.ops):
            self.waited = True
        return ok

    def wait(self) -> None:
        """Wait for every operation; a failure names the channel, the peer and the message."""
        if self.waited:
            return
        for op in self.ops:
            self.channel._complete(op)
        self.waited = True


class P2P:
    """The point-to-point channel of one process group (``comm``), on ``device``."""

    def __init__(
        self,
        comm: CommGroup,
        name: str,
        device: torch.device,
        timeout: timedelta,
        rules: CommRules | None = None,
    ) -> None:
        if comm.size < 2:
            raise ValueError(f"p2p channel {name!r}: a group of {comm.size} rank has no peers")
        self.comm, self.name, self.device, self.timeout = comm, name, device, timeout
        self.rules = comm_rules() if rules is None else rules
        pg = comm.group if comm.group is not None else dist.group.WORLD
        assert pg is not None, "a channel needs torch.distributed initialised"
        self._pg = pg
        self._key = pg.group_name
        with _open_lock:
            held = _open_groups.get(self._key)
            if held is not None and held() is pg:
                raise ValueError(
                    f"p2p channel {name!r}: process group {self._key} has a channel already "
                    "(NCCL orders each pair's messages per communicator: one channel per group)"
                )
            _open_groups[self._key] = weakref.ref(pg)
        self.backend = c10d.get_backend(pg)
        self.staged = via_host(device, pg)
        # Headers need a receive that can wait for them first: gloo only. On NCCL the rules
        # keep what is local (no tags, no ungrouped opposite directions).
        self.headers = self.rules is CommRules.NCCL and self.backend == "gloo"
        self._lock = threading.Lock()
        self._sent = [0] * comm.size
        self._received = [0] * comm.size
        self._open: list[list[Pending]] = [[] for _ in range(comm.size)]  # ungrouped, per peer
        self._receivers: dict[int, PeerReceiver] = {}
        # Collective: every rank of the group builds the channel (the communicator forms now).
        on = device if self.backend == "nccl" else torch.device("cpu")
        c10d.all_reduce(torch.zeros(1, device=on), group=pg)

    @property
    def me(self) -> int:
        return self.comm.ranks[self.comm.rank]

    def send(self, tensor: torch.Tensor, peer: int, label: str) -> Pending:
        """Post one send of ``tensor`` to group rank ``peer``."""
        return self._post([Send(peer, tensor, label)], grouped=False)

    def recv(self, buffer: torch.Tensor, peer: int, label: str) -> Pending:
        """Post one receive into ``buffer`` from group rank ``peer``."""
        return self._post([Recv(peer, buffer, label)], grouped=False)

    def exchange(self, ops: Sequence[Send | Recv]) -> Pending:
        """Post sends and receives as one batch: they progress together (NCCL: one group), so
        opposite directions between two peers cannot deadlock."""
        if not ops:
            raise ValueError(f"p2p channel {self.name!r}: an empty exchange")
        return self._post(list(ops), grouped=True)

    def close(self) -> None:
        with _open_lock:
            held = _open_groups.get(self._key)
            if held is not None and held() is self._pg:
                del _open_groups[self._key]

    # ---- posting ---------------------------------------------------------------------------

    def _post(self, ops: list[Send | Recv], grouped: bool) -> Pending:
        with self._lock:
            built = [self._build(op) for op in ops]
            pending = Pending(self, built, grouped)
            if not grouped and self.rules is CommRules.NCCL:
                self._refuse_opposite(built[0], pending)
            try:
                calls: list[_Call] = []
                for op, spec in zip(built, ops, strict=True):
                    calls += self._start(op, spec)
                if grouped and not self.headers and calls:
                    works = c10d.batch_isend_irecv([call.p2p_op(self._pg) for call in calls])
                else:
                    works = [call.post(self._pg) for call in calls]
            except RuntimeError as exc:
                raise RuntimeError(self._failed(built[0], exc)) from exc
            for call, work in zip(calls, works, strict=True):
                call.op.works.append(work)
            return pending

    def _build(self, spec: Send | Recv) -> _Op:
        tensor = spec.tensor if isinstance(spec, Send) else spec.buffer
        if not 0 <= spec.peer < self.comm.size or spec.peer == self.comm.rank:
            raise ValueError(
                f"p2p channel {self.name!r}: peer {spec.peer} of group rank {self.comm.rank} "
                f"in a group of {self.comm.size}"
            )
        what = describe(spec.label, tuple(tensor.shape), tensor.dtype)
        return _Op(isinstance(spec, Send), spec.peer, spec.label, what)

    def _start(self, op: _Op, spec: Send | Recv) -> list[_Call]:
        """The torch calls of one message, to post; a checked receive posts its header's
        receive here and its peer's receiver thread posts the payload's."""
        out: list[_Call] = []
        if isinstance(spec, Send):
            wire = spec.tensor.detach()
            wire = wire.cpu() if self.staged else wire.contiguous()
            op.keep.append(wire)
            if self.headers:
                head = Header.of(self._sent[op.peer], self.me, wire, op.label).encode()
                op.keep.append(head)
                out.append(_Call(op, c10d.isend, head, op.peer, HEADER_TAG))
            self._sent[op.peer] += 1
            if wire.numel():  # NCCL skips empty messages: nothing travels
                out.append(_Call(op, c10d.isend, wire, op.peer, self._payload_tag))
            return out
        buf = spec.buffer
        direct = not self.staged and buf.is_contiguous()
        wire = buf if direct else torch.empty(buf.shape, dtype=buf.dtype, device=self._wire)
        if not direct:
            op.finish = lambda: buf.copy_(wire)
        op.keep.append(wire)
        seq = self._received[op.peer]
        self._received[op.peer] += 1
        if self.headers:
            incoming = op.incoming = Incoming(self.me, seq, wire, op.label)
            incoming.header_work = _Call(op, c10d.irecv, incoming.header, op.peer, HEADER_TAG).post(
                self._pg
            )
            receiver = self._receivers.get(op.peer)
            if receiver is None:
                post = functools.partial(self._post_payload, op.peer)
                receiver = PeerReceiver(self.comm.ranks[op.peer], post)
                self._receivers[op.peer] = receiver
            receiver.add(incoming)
        elif wire.numel():
            out.append(_Call(op, c10d.irecv, wire, op.peer, self._payload_tag))
        return out

    @property
    def _payload_tag(self) -> int:
        # Plain traffic carries no tag at all (NCCL's contract); only the checked mode's
        # headers and payloads get hidden ones, each its own FIFO.
        return PAYLOAD_TAG if self.headers else 0

    @property
    def _wire(self) -> torch.device:
        return torch.device("cpu") if self.staged else self.device

    def _post_payload(self, peer: int, incoming: Incoming) -> Any:
        """Called by a peer's receiver thread once the header fits."""
        if not incoming.buffer.numel():
            return _Done()
        return _Call(None, c10d.irecv, incoming.buffer, peer, PAYLOAD_TAG).post(self._pg)

    def _refuse_opposite(self, op: _Op, pending: Pending) -> None:
        """NCCL runs a pair's operations in posting order: an ungrouped send that is not done
        blocks a later receive from the same peer (and the peer may do the same): one batch."""
        mine = self._open[op.peer]
        mine[:] = [p for p in mine if not p.waited]
        for earlier in mine:
            other = earlier.ops[0]
            if other.send != op.send:
                raise RuleViolation(
                    f"{COMM_RULES_ENV}=nccl, channel {self.name}: rank {self.me} posts "
                    f"{self._describe(op)} while its {self._describe(other)} is not waited for: "
                    "NCCL may deadlock on opposite-direction traffic between two peers that is "
                    "not one batched exchange (P2P.exchange)"
                )
        mine.append(pending)

    def _describe(self, op: _Op) -> str:
        peer = self.comm.ranks[op.peer]
        return (
            f"send of {op.what} to rank {peer}"
            if op.send
            else f"receive of {op.what} from rank {peer}"
        )

    def _failed(self, op: _Op, exc: BaseException) -> str:
        what = self._describe(op)
        return f"p2p channel {self.name}, rank {self.me}: {what} failed: {first_line(exc)}"

    def _complete(self, op: _Op) -> None:
        try:
            if op.incoming is not None:
                incoming = op.incoming
                if not incoming.ready.wait(self.timeout.total_seconds()):
                    raise RuntimeError(
                        f"no message within {self.timeout.total_seconds():.0f} s (is rank "
                        f"{self.comm.ranks[op.peer]} alive?)"
                    )
                incoming.raise_if_failed(self.name)
                incoming.payload_work.wait()
            for work in op.works:
                work.wait()
        except RuleViolation:
            raise
        except RuntimeError as exc:
            raise RuntimeError(self._failed(op, exc)) from exc
        if op.finish is not None:
            op.finish()


def _op_done(op: _Op) -> bool:
    incoming = op.incoming
    if incoming is not None:
        if not incoming.ready.is_set():
            return False
        if incoming.payload_work is None:
            return True  # failed: wait() says why
        if not incoming.payload_work.is_completed():
            return False
    return all(w.is_completed() for w in op.works)


class _Done:
    """The work of a message with nothing to move."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
