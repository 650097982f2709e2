"""The messages between a Tetris group's controller and its ranks (Tetris §4.1–4.2), one frozen
dataclass each, and the codecs that carry them without pickle (``worker/wire.py``).

The controller (``controller.py``, node 0) speaks to each prefill rank and to each decode
instance's leader over one ``links.Link``: a pipe for this host's ranks, a socket to node 0's
control listener for the other nodes' (``listener.py``, where a dialler first says ``Hello``).
A request's hand-off, piece by piece:

    controller → pool:    Prefill, then per piece Go (whole) or StreamGo (layer-wise); Cancel
    pool → controller:    Prefilled, Offer (whole: a piece is ready), WholeSent / WholeUnsent,
                          StreamSent, PrefillFailed
    controller → decode:  Expect, then per piece Receive (whole) or Post + Complete (layer-wise)
    decode → controller:  Output, Landed, Refused, TransferFailed, Snapshot (on AskSnapshot)

Every rank answers its start with ``Loaded`` and its ``Stop`` with ``Closed``; probes of the
running pool (``Worker.ProfileTetris``) are ``Probe`` → ``Probed`` / ``ProbeFailed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.wire import Codec

PieceRows = tuple[int, int]  # (first row, row count) of a member's rows: one piece


# ---- either way ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An instance leader of another node, first thing on its connection: its global rank."""

    rank: int


@dataclass(frozen=True)
class Loaded:
    """A rank has joined the group and loaded its shard (decode: its engine's context)."""

    num_blocks: int
    max_model_len: int = 0


@dataclass(frozen=True)
class Stop:
    """Finish what is in flight, answer ``Closed`` and exit."""


@dataclass(frozen=True)
class Closed:
    """A rank's last message; a decode leader reports what its KV blocks look like."""

    leaked_blocks: int = 0
    all_free: bool = True
    posted_receives: int = 0


# ---- controller → prefill rank ---------------------------------------------------------------


@dataclass(frozen=True)
class Prefill:
    """Run ``chunks`` (this member is in the last one's group), then hand over ``pieces`` of
    this member's rows to the decode ranks ``receivers``."""

    rid: str
    ids: tuple[int, ...]
    chunks: tuple[PlannedChunk, ...]
    pieces: tuple[PieceRows, ...]
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class Go:
    """Whole hand-off: piece ``piece`` has transfer slot ``slot``; send it there as grant
    ``xfer`` (its messages' label)."""

    rid: str
    piece: int
    slot: int
    xfer: int


@dataclass(frozen=True)
class StreamGo:
    """Layer-wise hand-off: the decode ranks posted the receives of grant ``xfer`` on slot
    ``slot``; send each layer of the piece's ``rows`` rows there as it is computed."""

    rid: str
    piece: int
    slot: int
    xfer: int
    rows: int
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class Cancel:
    """Forget the request (its pieces already granted are still sent whole)."""

    rid: str


@dataclass(frozen=True)
class Probe:
    """Time ``chunks`` on a random prompt (``seed``); nothing is kept or handed over."""

    pid: str
    chunks: tuple[PlannedChunk, ...]
    seed: int


# ---- prefill rank → controller ---------------------------------------------------------------


@dataclass(frozen=True)
class Prefilled:
    """The member's prefill of ``rid`` ended after ``seconds`` (its TP rank 0 speaks)."""

    rid: str
    seconds: float


@dataclass(frozen=True)
class Offer:
    """Whole hand-off: piece ``piece`` of ``rid`` is ready; ask the decode side for a slot."""

    rid: str
    piece: int


@dataclass(frozen=True)
class WholeSent:
    """This rank's share of a granted whole piece is on its way (``mid_prefill``: its sends
    started between the layers of a later prefill)."""

    rid: str
    piece: int
    mid_prefill: bool


@dataclass(frozen=True)
class WholeUnsent:
    """A granted whole piece this rank no longer holds: nothing was sent."""

    rid: str
    piece: int


@dataclass(frozen=True)
class StreamSent:
    """This rank sent every layer of a streamed piece (``sent`` False: zeros, its prefill
    failed); ``layers`` sent, ``early`` of them while the prefill still computed."""

    rid: str
    piece: int
    sent: bool
    early: int
    layers: int


@dataclass(frozen=True)
class PrefillFailed:
    """The member could not run or hand over ``rid`` (a ring peer died, a decode rank is gone)."""

    rid: str
    why: str


@dataclass(frozen=True)
class Probed:
    """Each chunk's seconds of a ``Probe`` on this member."""

    pid: str
    seconds: tuple[float, ...]


@dataclass(frozen=True)
class ProbeFailed:
    pid: str
    why: str


# ---- controller → decode leader --------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """Queue ``rid`` and reserve its prompt's KV blocks; ``pieces`` will land."""

    rid: str
    ids: tuple[int, ...]
    params: SamplingParams
    pieces: int


@dataclass(frozen=True)
class Receive:
    """Whole hand-off: receive ``rows`` rows of piece ``piece`` (grant ``xfer``, on slot
    ``slot``) from prefill instance ``member`` in the next step (its sender is already
    sending)."""

    rid: str
    member: int
    rows: int
    piece: int
    slot: int
    xfer: int


@dataclass(frozen=True)
class Post:
    """Layer-wise: post the receives of a granted piece (grant ``xfer``, on slot ``slot``) in
    the next step."""

    rid: str
    member: int
    rows: int
    piece: int
    slot: int
    xfer: int


@dataclass(frozen=True)
class Complete:
    """Layer-wise: every layer of grant ``xfer`` is sent (``dropped``: zeros, or the member
    died); finish the receives in the next step."""

    rid: str
    member: int
    piece: int
    xfer: int
    dropped: bool


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class AskSnapshot:
    """Report the engine's stats and the rows reserved by requests in transfer."""


# ---- decode leader → controller --------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    out: RequestOutput


@dataclass(frozen=True)
class Landed:
    """Piece ``piece`` of ``rid`` is in the decode instance's cache; its slot ``slot`` frees."""

    rid: str
    piece: int
    slot: int


@dataclass(frozen=True)
class Refused:
    """The decode instance's engine refused ``rid`` (InvalidRequestError's field and text)."""

    rid: str
    field: str
    message: str


@dataclass(frozen=True)
class TransferFailed:
    rid: str
    why: str


@dataclass(frozen=True)
class Snapshot:
    stats: EngineStats
    reserved_rows: int
    block_size: int


# One codec per direction (``worker/wire.py``): a message of another direction is refused.
ToPool = Prefill | Go | StreamGo | Cancel | Probe | Stop
FromPool = (
    Loaded
    | Prefilled
    | Offer
    | WholeSent
    | WholeUnsent
    | StreamSent
    | PrefillFailed
    | Probed
    | ProbeFailed
    | Closed
)
ToDecode = Expect | Receive | Post | Complete | Abort | AskSnapshot | Stop
FromDecode = Loaded | Output | Landed | Refused | TransferFailed | Snapshot | Closed

HELLO: Codec[Hello] = Codec([Hello])
TO_POOL: Codec[ToPool] = Codec([Prefill, Go, StreamGo, Cancel, Probe, Stop])
FROM_POOL: Codec[FromPool] = Codec(
    [
        Loaded,
        Prefilled,
        Offer,
        WholeSent,
        WholeUnsent,
        StreamSent,
        PrefillFailed,
        Probed,
        ProbeFailed,
        Closed,
    ]
)
TO_DECODE: Codec[ToDecode] = Codec([Expect, Receive, Post, Complete, Abort, AskSnapshot, Stop])
FROM_DECODE: Codec[FromDecode] = Codec(
    [Loaded, Output, Landed, Refused, TransferFailed, Snapshot, Closed],
    namespace={"TokenLogprobs": TokenLogprobs},  # RequestOutput names it only for mypy
)
