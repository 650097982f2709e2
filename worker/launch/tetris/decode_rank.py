"""A decode instance's ranks: its leader runs the instance's engine, driven by the controller
over a link (requests expected, pieces received, outputs out), and its other ranks follow the
leader's plans (Tetris §4.2: the decode side of the hand-off, ``policies/tetris/decode.py``).
"""

from __future__ import annotations

from gearshift.worker.engine.control import SHUTDOWN, STEP, ControlChannel
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch.replica_rank import IDLE_WAIT_S
from gearshift.worker.launch.tetris.links import LeaderLink
from gearshift.worker.launch.tetris.messages import (
    Abort,
    AskSnapshot,
    Complete,
    Expect,
    Landed,
    Output,
    Post,
    Receive,
    Refused,
    Snapshot,
    Stop,
    ToDecode,
    TransferFailed,
)
from gearshift.worker.policies.tetris.admission import DecodeAdmission
from gearshift.worker.policies.tetris.policy import TetrisPolicy


def run_decode_leader(
    engine: LLMEngine, policy: TetrisPolicy, link: LeaderLink, block_size: int
) -> None:
    """The leader's loop: the controller's messages between steps, then a step while anything
    runs or is in transfer; returns after ``Stop`` once nothing is in transfer."""
    admission = policy.admission
    assert admission is not None
    stopping = False
    while True:
        busy = engine.has_unfinished_requests() or admission.has_work
        while link.poll(0 if busy else IDLE_WAIT_S):
            stopping = _handle(engine, admission, link, link.recv(), block_size) or stopping
            busy = engine.has_unfinished_requests() or admission.has_work
        if busy:
            for out in engine.step():
                link.send(Output(out))
            landed, failed = admission.take_reports()
            for rid, piece, slot in landed:
                link.send(Landed(rid, piece, slot))
            for rid, why in failed:
                engine.abort_request(rid)
                link.send(TransferFailed(rid, why))
            continue
        if stopping and not admission.incoming:
            return
        engine.keepalive()


def _handle(
    engine: LLMEngine,
    admission: DecodeAdmission,
    link: LeaderLink,
    msg: ToDecode,
    block_size: int,
) -> bool:
    """Apply one message; True for ``Stop``."""
    if isinstance(msg, Expect):
        try:
            engine.add_request(msg.rid, list(msg.ids), msg.params)
            admission.expect(msg.rid, msg.pieces)
        except InvalidRequestError as exc:
            engine.abort_request(msg.rid)
            link.send(Refused(msg.rid, exc.field, exc.message))
    elif isinstance(msg, Receive):
        admission.receive(msg.rid, msg.member, msg.rows, msg.piece, msg.slot, msg.xfer)
    elif isinstance(msg, Post):
        admission.post(msg.rid, msg.member, msg.rows, msg.piece, msg.slot, msg.xfer)
    elif isinstance(msg, Complete):
        admission.complete(msg.rid, msg.xfer, msg.dropped)
    elif isinstance(msg, Abort):
        engine.abort_request(msg.rid)
        admission.abort(msg.rid)
    elif isinstance(msg, AskSnapshot):
        link.send(Snapshot(engine.stats(), admission.reserved_rows(), block_size))
    return isinstance(msg, Stop)


def follow_decode_leader(runner: ModelRunner, channel: ControlChannel) -> None:
    """A decode instance's other rank: run every plan its leader sends until it says stop."""
    while True:
        kind, plan = channel.recv()
        if kind == SHUTDOWN:
            break
        if kind == STEP and isinstance(plan, StepPlan):
            runner.execute(plan)
    runner.flush()
    runner.shutdown()
