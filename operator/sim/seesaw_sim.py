"""Seesaw in the simulator (issue 16: each new policy once it exists; Seesaw §4): the engine's own
leader (``worker/policies/seesaw/leader.py``: its prefill and decode phases, the host KV pages,
the transition-minimising switches) drives each replica's steps in simulated time, and each step
is priced by the gear its phase runs on.

- Prefill phase: the prefill gear (PP over the group's GPUs, micro-batches in flight); decode
  phase: the decode gear (TP over the same GPUs). Gears are the pure ones the roofline prices
  (``P1xG -> DGx1``, the pair the paper's PCIe results favour, Fig. 10).
- KV to the host store overlaps the prefill compute it follows (§4.3): a step takes the longer of
  the two. (Measured prices without that overlap, the engine's ``asyncSwap: false``, add the
  write to the step, and the step waits at a barrier of every rank, draining the pipeline.)
  KV back to the device is copied before the step that needs it (the leader without
  ``async_swap``: no rank reports exist here), so its time adds.
- A switch re-shards: each GPU reloads its shard of the weights from pinned host memory over its
  host link (§4.1), before the switching step runs.
- The host store holds ``HOST_BYTES_PER_GPU`` per GPU (Seesaw §6.1: 80 GiB of CPU memory per
  GPU); switch points and prefetch limits are the policy's defaults.

``Measured`` replaces every price above by what a running engine showed on the machine at hand
(``benchmarks/sim_fidelity_seesaw.py``): each gear's profiled step, one block's copy, one
re-shard, the host store's size, and whether KV writes overlap compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import json_format

from gearshift.operator.sim.blocks import SimPageAllocator
from gearshift.operator.sim.cost_model import StepCost
from gearshift.operator.sim.hardware import Hardware, with_count
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.roofline import Layout, RooflineCost
from gearshift.v1 import policy_pb2
from gearshift.worker.engine.contract import QueueView, StepRequest
from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.policies import checks
from gearshift.worker.policies.seesaw.leader import Phase, SeesawLeader, Thresholds
from gearshift.worker.policies.seesaw.readiness import ReadinessBoard

HOST_BYTES_PER_GPU = 80 * (1 << 30)


def policy(gpus: int) -> dict[str, dict[str, dict[str, int]]]:
    return {"seesaw": {"prefill": {"tp": 1, "pp": gpus}, "decode": {"tp": gpus, "pp": 1}}}


def _thresholds(gpus: int) -> Thresholds:
    """The policy's default switch points and prefetch limit."""
    msg = checks.with_defaults(_proto(gpus), gpus).seesaw
    return Thresholds(
        msg.switch_to_decode_at_host_usage,
        msg.switch_to_prefill_at_host_usage,
        msg.prefetch_max_sequences,
    )


def _proto(gpus: int) -> policy_pb2.Policy:
    return json_format.ParseDict(policy(gpus), policy_pb2.Policy())


@dataclass(frozen=True)
class Measured:
    """Seesaw's prices from measurements instead of the roofline (each block figure is the whole
    group's share of one KV block)."""

    prefill: StepCost  # the prefill gear's step (its whole pipeline traversal)
    decode: StepCost  # the decode gear's step
    copy_in_block_s: float  # one block from the host store
    copy_out_block_s: float  # one block to the host store
    reshard_s: float  # one gear switch
    host_pages: int  # blocks the host store holds
    # KV writes beside compute (a copy engine, ``asyncSwap``), or before it: then a step that
    # writes KV starts with a barrier of every rank (the engine's synchronous swap-out), so on
    # the pipelined prefill gear it waits for the micro-batch ahead of it to leave.
    overlap_out: bool = False


@dataclass
class SeesawHooks:
    """One replica's Seesaw leader and the price of each step (replica.SimHooks)."""

    model: ModelDesc
    hw: Hardware | None  # prices the steps when nothing is ``measured``
    gpus: int
    block_size: int
    measured: Measured | None = None
    leader: SeesawLeader = field(init=False)
    _barrier: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        block_bytes = self.model.kv_bytes_per_token() * self.block_size
        m = self.measured
        pages = m.host_pages if m else int(HOST_BYTES_PER_GPU * self.gpus // block_bytes)
        thresholds = _thresholds(self.gpus)
        self.leader = SeesawLeader(
            SimPageAllocator(pages),  # the same pages, made as they are handed out
            self.block_size,
            (self.gpus, 1),
            lambda: thresholds,
            block_bytes,
            ReadinessBoard([0] * (self.gpus + 1), [0] * self.gpus),
            async_swap=False,
        )
        if m is not None:
            self._prefill: StepCost = m.prefill
            self._decode: StepCost = m.decode
            self._copy_in_s, self._copy_out_s = m.copy_in_block_s, m.copy_out_block_s
            self._reshard_s, self._overlap_out = m.reshard_s, m.overlap_out
            return
        assert self.hw is not None, "SeesawHooks needs hardware or measured prices"
        group = with_count(self.hw, self.gpus)
        self._prefill = RooflineCost(self.model, group, Layout("pp", self.gpus))
        self._decode = RooflineCost(self.model, group, Layout("tp", self.gpus))
        # Every GPU moves its 1/G of a block, and its 1/G of the weights, over its own link; KV
        # writes overlap compute (§4.3).
        self._copy_in_s = self._copy_out_s = block_bytes / self.gpus / self.hw.host_device.bandwidth
        self._reshard_s = self.model.weight_bytes() / self.gpus / self.hw.host_device.bandwidth
        self._overlap_out = True

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.leader.bind(scheduler, blocks)

    def step_request(self, queues: QueueView) -> StepRequest:
        return self.leader.step_request(queues)

    def held(self) -> frozenset[str]:
        return self.leader.held()

    def step_submitted(self) -> None:
        self.leader.step_submitted()

    def micro_batches(self) -> int:
        return self.gpus if self.leader.phase is Phase.PREFILL else 1

    def step_time(self, batch: ScheduledBatch) -> tuple[float, int]:
        prefill = self.leader.phase is Phase.PREFILL
        compute = 0.0
        if not batch.is_empty:
            compute = (self._prefill if prefill else self._decode).step_time(batch)
        blocks_out, blocks_in, switching = self.leader.pending
        out_s, in_s = blocks_out * self._copy_out_s, blocks_in * self._copy_in_s
        reshard = self._reshard_s if switching else 0.0
        trip = reshard + in_s + (max(compute, out_s) if self._overlap_out else compute + out_s)
        self._barrier = blocks_out > 0 and not self._overlap_out
        return trip, self.gpus if prefill else 1

    def barrier(self) -> bool:
        """The step ``step_time`` just priced writes KV synchronously: every rank meets at a
        barrier first (``rank_hook.before_step``)."""
        return self._barrier

    @property
    def transitions(self) -> int:
        return len(self.leader.transitions)
