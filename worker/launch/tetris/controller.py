"""The controller of a running Tetris group: the calling process's handle on it (Tetris §3.2
topology, §4.1 CDSP execution, §4.2 hand-off with handshake).

A request goes like this:

1. ``submit``: the plan (the router's, or one chunk over the whole pool) is checked; the chosen
   decode instance is told to expect the request (its engine checks it like any request and
   reserves the prompt's KV blocks); the decode instance's ``ReceiveManager`` (kept here, on its
   behalf) is announced the pieces; every member of the plan's last group gets the request, in
   one global order, so rings on shared members never cross.
2. A member runs the chunks it is in (``pool_rank.py``), then offers each piece of its rows (at
   most a transfer buffer each); the handshake threads (``handshakes.py``) grant them, and the
   member's report that a piece is on its way makes the decode leader receive it in its next
   step (``reader.py``). With ``layerwise_transfer`` every piece is handshaken at submit and
   its layers leave as they are computed.
3. The decode leader reports each landed piece (the slot frees); with the last one it admits the
   request into its running batch, and its outputs stream back through here.

Failures (``failures.py``): a request fails alone when its plan cannot finish, a dead prefill
instance is avoided, a dead decode rank ends the group.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict

from gearshift.v1 import worker_pb2
from gearshift.worker.engine.llm_engine import InstanceLoad
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.processes import stop_processes
from gearshift.worker.launch.tetris.failures import DEAD_QUEUE_S
from gearshift.worker.launch.tetris.handshakes import handshake_loop
from gearshift.worker.launch.tetris.messages import Closed, Expect, Prefill, Stop
from gearshift.worker.launch.tetris.probes import profile_running_pool
from gearshift.worker.launch.tetris.reader import read_loop
from gearshift.worker.launch.tetris.state import GroupState, RequestState, pieces_of
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk, check_plan, rows_after
from gearshift.worker.policies.tetris.transfer import ReceiveManager
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.wire import WireError

STOP_POLL_S = 0.05  # between looks for a decode leader's Closed at shutdown


class TetrisGroup(GroupState):
    """The calling process's handle on a running Tetris group (see the module docstring)."""

    def start_threads(self) -> None:
        """The reader and one handshake thread per prefill instance."""
        self.managers = [
            ReceiveManager(int(self.policy.message.transfer_backends))
            for _ in range(self.policy.decode)
        ]
        self.snapshots = [None] * self.policy.decode
        self.handshakes = [queue.Queue() for _ in self.pool_conns]
        self.threads = [threading.Thread(target=read_loop, args=(self,), name="tetris-reader")]
        self.threads += [
            threading.Thread(target=handshake_loop, args=(self, m), name=f"tetris-hs-{m}")
            for m in range(len(self.pool_conns))
        ]
        for thread in self.threads:
            thread.daemon = True
            thread.start()

    # ---- requests ----------------------------------------------------------------------------

    def default_plan(self, prompt_tokens: int) -> worker_pb2.TetrisPlan:
        """No router plan: one chunk over every live prefill instance, the decode instance with
        the fewest requests (WorkerGenerateRequest.tetris_plan)."""
        live = [m for m in range(self.policy.prefill) if m not in self.dead_pool]
        with self.lock:
            load = [0] * self.policy.decode
            for req in self.requests.values():
                load[req.decode] += 1
        for d, snap in enumerate(self.snapshots):
            if snap is not None:
                load[d] += snap.stats.num_running
        decode = min(range(self.policy.decode), key=load.__getitem__)
        plan = worker_pb2.TetrisPlan(decode_instance=decode)
        plan.chunks.add(num_tokens=prompt_tokens, prefill_instances=live)
        return plan

    def submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        plan: worker_pb2.TetrisPlan | None,
    ) -> None:
        """Start a request (raises InvalidRequestError for a plan the group cannot run, or
        GroupFailure when the plan names a dead prefill instance); its outputs come through
        ``deliver``."""
        if self.closed:
            raise GroupFailure(self.dead or "the tetris group is shutting down")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs",
                "prompt_logprobs: the tetris policy's prefill pool computes no prompt logits",
            )
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty")
        plan = plan if plan is not None else self.default_plan(len(ids))
        chunks = [PlannedChunk(c.num_tokens, tuple(c.prefill_instances)) for c in plan.chunks]
        try:
            check_plan(chunks, len(ids), self.policy.prefill)
        except ValueError as exc:
            raise InvalidRequestError("tetris_plan", f"tetris_plan: {exc}") from exc
        d = plan.decode_instance
        if d >= self.policy.decode:
            raise InvalidRequestError(
                "tetris_plan.decode_instance",
                f"tetris_plan.decode_instance {d}: this group has {self.policy.decode} decode "
                "instances, numbered from 0",
            )
        dead = sorted(set(chunks[-1].group) & set(self.dead_pool))
        if dead:
            raise GroupFailure(f"prefill instance {dead[0]} is down: {self.dead_pool[dead[0]]}")
        buffer = int(self.policy.message.transfer_buffer_bytes)
        pieces = pieces_of(rows_after(chunks), self.row_bytes, buffer)
        members = chunks[-1].group
        req = RequestState(d, members, pieces, plan.planned_prefill_seconds, time.monotonic())
        req.total = sum(len(p) for p in pieces.values())
        with self.lock:
            if rid in self.requests:
                raise InvalidRequestError("request_id", f"request id {rid!r} is already running")
            self.requests[rid] = req
            self.managers[d].announce(rid, req.total, len(ids))
            receivers = tuple(self.policy.decode_ranks(d))
            self.send(self.decode_conns[d], Expect(rid, tuple(ids), params, req.total))
            for m in req.members:  # in one global order: rings on shared members never cross
                mine = tuple(pieces.get(m, []))
                self.to_pool(m, Prefill(rid, tuple(ids), tuple(chunks), mine, receivers))
            if self.layerwise:  # the handshakes run while the pool computes (§4.2)
                for m, own in pieces.items():
                    for i in range(len(own)):
                        self.handshakes[m].put((rid, i))

    def abort(self, rid: str) -> bool:
        """Release ``rid`` wherever it is; False if it is not running."""
        with self.lock:
            req = self.requests.pop(rid, None)
        if req is None:
            return False
        self.release(rid, req)
        return True

    # Time CDSP prefill on the running pool, between its requests (Worker.ProfileTetris).
    profile = profile_running_pool

    # ---- what it reports ---------------------------------------------------------------------

    def instances(self) -> list[InstanceLoad]:
        """The planner's view (§5.1–5.2): each prefill instance's queue T_k (the planned end of
        the requests it still has), each decode instance's KV room, reservations and batch."""
        now = time.monotonic()
        out = []
        with self.lock:
            reqs = list(self.requests.values())
        for m in range(self.policy.prefill):
            if m in self.dead_pool:
                queued = DEAD_QUEUE_S
            else:
                ends = [
                    r.submitted + r.planned_s - now
                    for r in reqs
                    if m in r.members and r.prefilled == 0
                ]
                queued = max([0.0, *ends])
            node = self.node(self.policy.prefill_ranks(m)[0])
            out.append(InstanceLoad("prefill", m, queued, 0, 0, 0, node))
        for d, snap in enumerate(self.snapshots):
            node = self.node(self.policy.decode_ranks(d)[0])
            if snap is None:
                out.append(InstanceLoad("decode", d, 0.0, 0, 0, 0, node))
                continue
            stats, reserved = snap.stats, snap.reserved_rows
            # Slots not held by admitted requests (InstanceStats): the blocks reserved for
            # requests in transfer are reported apart, as virtual usage.
            free = (stats.kv_blocks_total - stats.kv_blocks_used) * snap.block_size + reserved
            total = stats.kv_blocks_total * snap.block_size  # what it holds when empty
            out.append(
                InstanceLoad("decode", d, 0.0, free, reserved, stats.num_running, node, total)
            )
        return out

    def stats(self) -> dict[str, float]:
        """The hand-off's figures (§4.2) as policy stats."""
        t = self.transfer
        waiting = sum(m.waiting_handshakes for m in self.managers)
        return {
            "prefills": float(t.prefills),
            "prefill_seconds_sum": t.prefill_seconds,
            "planned_prefill_seconds_sum": t.planned_seconds,
            "transfer_waits": float(t.waits),
            "transfer_wait_seconds_sum": t.wait_seconds,
            "handshake_queue": float(waiting),
            "transfer_slots_free": float(sum(m.free_slots for m in self.managers)),
            "requests_failed": float(t.failed),
            "prefill_instances_down": float(len(self.dead_pool)),
            "streamed_layers": float(t.streamed_layers),
            "streamed_layers_early": float(t.streamed_early),
            "pieces_sent_mid_prefill": float(t.sent_mid_prefill),
        }

    # ---- ending ------------------------------------------------------------------------------

    def shutdown(self) -> list[dict[str, int | bool]]:
        """Stop every instance; what each decode instance reported about its KV blocks."""
        if self.closed:
            return []
        self.stop.set()
        for t in self.threads:
            t.join(5)
        reports = []
        for m in range(len(self.pool_conns)):
            if m not in self.dead_pool:
                self.to_pool(m, Stop())
        for link in self.decode_conns:
            self.send(link, Stop())
        deadline = time.monotonic() + self.timeout_s
        for link in self.decode_conns:
            while time.monotonic() < deadline:
                try:
                    if link.poll(STOP_POLL_S):
                        msg = link.recv()
                        if isinstance(msg, Closed):
                            reports.append(asdict(msg))
                            break
                except (EOFError, OSError, WireError):
                    break
        self.closed = True
        stop_processes(self.procs, timeout=10)
        for link in self.all_links():
            link.close()
        self.store = None
        return reports
