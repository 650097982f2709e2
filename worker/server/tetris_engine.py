"""The worker endpoint of a Tetris group: the one EngineHandle the gRPC service sees (the
Tetris group runtime's endpoint, ``runtimes.py``; the group itself is ``launch/tetris/``).

A request carries the router's chunk plan (``WorkerGenerateRequest.tetris_plan``); without one
the group plans one chunk over every live prefill instance. A policy without latency models gets
them measured and fitted on the group's own pool before it serves (``launch/tetris/autofit.py``),
reported in ``WorkerStats.tetris_models`` for the router's planner. Stats are the decode instances'
engine stats summed, with ``instances`` (the planner's view, §5.1–5.2) and the hand-off's figures
(measured vs planned prefill seconds, transfer waits, the handshake queue) as policy stats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace

from google.protobuf.message import Message

from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.tetris import autofit
from gearshift.worker.launch.tetris.controller import TetrisGroup
from gearshift.worker.launch.tetris.start import start_tetris
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.server.engine_loop import EngineStopped, OutputSink
from gearshift.worker.server.engine_process import EngineStartError
from gearshift.worker.server.factory import engine_config, group_config
from gearshift.worker.server.replica_engine import merge_stats
from gearshift.worker.server.settings import WorkerSettings

log = logging.getLogger(__name__)


class TetrisGroupEngine:
    """An EngineHandle over a Tetris group hosted by this process."""

    plan_field: str | None = "tetris_plan"  # the router planner's chunk plan (handle.py)

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        policy = make_policy(settings.policy, settings.ranks)
        assert isinstance(policy, TetrisPolicy)
        self._policy = policy
        self.policy = policy.to_proto()
        self.max_model_len = 0
        self.replicas = 1
        self._group: TetrisGroup | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._models = autofit.off_status("the group has not started")

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        config = engine_config(self.settings)
        group = group_config(
            self._policy,
            heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
            control_token=self.settings.control_token,
        )
        try:
            self._group = await asyncio.to_thread(
                start_tetris, config, self._policy, group, self._deliver
            )
        except Exception as exc:
            raise EngineStartError(f"{type(exc).__name__}: {exc}") from exc
        self.max_model_len = self._group.max_model_len
        await self._fit_models(self._group)

    async def _fit_models(self, group: TetrisGroup) -> None:
        """Before serving: measure and fit Eq. (1) when the policy has no latency models."""
        tetris = self.policy.tetris
        try:
            tokens = autofit.profile_tokens(tetris, group.max_model_len)
        except InvalidRequestError as exc:
            raise EngineStartError(exc.message) from exc
        if tetris.latency_models:
            return  # reported as POLICY (stats_extra)
        if not tokens:
            self._models = autofit.off_status(
                "autoProfileTokens is 0 (or the model's context is under 8 tokens): no models, "
                "each prompt runs as one chunk over the whole pool"
            )
            return
        stop = threading.Event()

        def profile(
            sizes: Sequence[int], histories: Sequence[int], lengths: Sequence[int], repeats: int
        ) -> list[tuple[int, int, int, float]]:
            return group.profile(sizes, histories, lengths, repeats, stop)

        try:
            self._models = await asyncio.to_thread(autofit.fit_pool, profile, tokens)
        except GroupFailure as exc:
            raise EngineStartError(f"tetris start-up profile: {exc}") from exc
        except asyncio.CancelledError:
            stop.set()  # stopped while starting: the profile ends at its next point
            raise
        log.info("tetris latency models: %s", self._models.message)

    @property
    def stats_extra(self) -> worker_pb2.WorkerStats:
        """Where the router's planner gets Eq. (1) from (``WorkerStats.tetris_models``)."""
        out = worker_pb2.WorkerStats()
        if self.policy.tetris.latency_models:
            out.tetris_models.source = worker_pb2.TetrisModelStatus.POLICY
        else:
            out.tetris_models.CopyFrom(self._models)
        return out

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._hand, rid, item)

    def _hand(self, rid: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._sinks[rid]
        sink(item)

    @property
    def snapshot(self) -> EngineStats:
        group = self._group
        if group is None:
            return merge_stats([], {})
        parts = [s.stats for s in group.snapshots if s is not None]
        return replace(
            merge_stats(parts, group.stats()), instances=group.instances(), gear="decode"
        )

    @property
    def dead(self) -> str | None:
        return None if self._group is None else self._group.dead

    @property
    def alive(self) -> bool:
        return self._group is not None and not self._group.closed

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        arrival_time: float,
        replica: int | None = None,
        plan: Message | None = None,
    ) -> None:
        del arrival_time, replica  # the decode instance stamps its own; one endpoint
        group = self._group
        if group is None or group.closed:
            sink(EngineStopped(self.dead or "the tetris group is shutting down"))
            return
        self._sinks[request_id] = sink
        try:
            if plan is not None and not isinstance(plan, worker_pb2.TetrisPlan):
                raise TypeError(f"a tetris group takes a TetrisPlan, not {type(plan).__name__}")
            group.submit(request_id, prompt_token_ids, params, plan)
        except (GroupFailure, ValueError) as exc:
            self._sinks.pop(request_id, None)
            sink(exc)

    async def abort(self, request_id: str) -> bool:
        if self._sinks.pop(request_id, None) is None or self._group is None:
            return False
        return self._group.abort(request_id)

    async def profile_tetris(
        self, sizes: list[int], histories: list[int], lengths: list[int], repeats: int
    ) -> list[tuple[int, int, int, float]]:
        """Worker.ProfileTetris: ``TetrisGroup.profile`` on a thread (the probes queue with
        live requests on the pool)."""
        group = self._group
        if group is None or group.closed:
            raise EngineStopped(self.dead or "the tetris group is shutting down")
        stop = threading.Event()
        try:
            return await asyncio.to_thread(group.profile, sizes, histories, lengths, repeats, stop)
        except asyncio.CancelledError:
            stop.set()  # a cancelled call: the profile stops at its next point
            raise

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy:
        # The live fields steer the router's planner, which reads them from GetStats.
        self._policy.update_live(values)
        self.policy = self._policy.to_proto()
        return self.policy

    async def stop(self, timeout_s: float = 15.0) -> None:
        del timeout_s
        group, self._group = self._group, None
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(EngineStopped("the engine stopped"))
        if group is None:
            return
        for rid in list(sinks):
            group.abort(rid)
        try:
            await asyncio.to_thread(group.shutdown)
        except (OSError, GroupFailure, RuntimeError) as exc:
            log.warning("tetris group stopped uncleanly: %s", exc)
        group.kill()
