"""What the gRPC service needs from an engine, on its event loop: in a thread or a process.

`ProcessEngine` (engine_process.py) is what `gearshift worker` runs: the engine in its own
process, so the gRPC loop never competes with the forward pass for the GIL. `ThreadEngine` runs
the same loop on a thread of this process (tests, tiny models).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from google.protobuf.message import Message

from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats, LLMEngine
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.server.engine_loop import Deliver, Delivery, EngineLoop, OutputSink

# The fields of WorkerGenerateRequest that carry a plan the router made for one request under
# its group's policy (worker.proto). A handle names the one it takes (``plan_field``); a request
# that sets another is refused, naming the field.
REQUEST_PLAN_FIELDS = ("tetris_plan",)


class EngineHandle(Protocol):
    """An engine driven on the caller's event loop; sinks run on that loop."""

    max_model_len: int
    policy: policy_pb2.Policy  # the active policy, defaults filled in
    replicas: int  # engine replicas behind this handle (a request may name one: submit)
    plan_field: str | None  # the request plan field it takes (REQUEST_PLAN_FIELDS), if any

    @property
    def snapshot(self) -> EngineStats: ...

    @property
    def stats_extra(self) -> worker_pb2.WorkerStats | None:
        """Fields GetStats reports beyond the engine's stats (merged in), if any."""

    @property
    def dead(self) -> str | None: ...

    @property
    def alive(self) -> bool: ...

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
        """``replica``: which engine replica runs it (checked < ``replicas`` by the caller);
        None: the handle picks. ``plan``: the request's ``plan_field`` when set."""

    async def abort(self, request_id: str) -> bool: ...

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy: ...

    async def stop(self) -> None: ...


def deliver_on(loop: asyncio.AbstractEventLoop) -> Deliver:
    """An EngineLoop `deliver` that runs each step's sinks on `loop`, in one callback."""

    def run(batch: Delivery) -> None:
        for sink, item in batch:
            sink(item)

    def deliver(batch: Delivery) -> None:
        loop.call_soon_threadsafe(run, batch)

    return deliver


class ThreadEngine:
    """An EngineLoop on a thread of this process, as an EngineHandle."""

    def __init__(self, engine: LLMEngine, ranks: int = 1, idle_wait: float = 0.5) -> None:
        self.engine = engine
        self.ranks = ranks
        self.replicas = 1
        self.plan_field: str | None = None
        self.max_model_len = engine.max_model_len
        self.policy = engine.policy.to_proto()
        self.loop = EngineLoop(engine, deliver_on(asyncio.get_running_loop()), idle_wait)
        self.loop.start()

    @property
    def snapshot(self) -> EngineStats:
        return self.loop.snapshot

    @property
    def stats_extra(self) -> worker_pb2.WorkerStats | None:
        return None

    @property
    def dead(self) -> str | None:
        return self.loop.dead

    @property
    def alive(self) -> bool:
        return self.loop.alive

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
        del replica, plan  # one engine: the caller checked it is 0 or None; takes no plan
        self.loop.submit(request_id, prompt_token_ids, params, sink, arrival_time)

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.loop.abort(request_id))

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy:
        def apply(engine: LLMEngine) -> policy_pb2.Policy:
            engine.policy.update_live(values)  # on the engine thread, between two steps
            return engine.policy.to_proto()

        self.policy = await asyncio.wrap_future(self.loop.call(apply))
        return self.policy

    async def stop(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        await asyncio.to_thread(self.engine.shutdown)
