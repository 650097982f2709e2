"""SiDP's simulated cost and its ``gearshift plan`` candidates (issue 16: each new policy once it
exists; SiDP §3–4).

A SiDP group of ``dp × tp`` GPUs on one node is ``dp`` independent engine replicas of ``tp`` ranks
(each with its own scheduler, as the engine runs them), so the simulator routes over
``groups × dp`` replicas. What differs from static TP ``tp`` with ``dp`` replicas:

- **Memory** (§3.1, §4.1): every rank holds its TP shard of attention, norms and embeddings, but
  only the FFN of the layers its replica owns (layer ℓ on replica ℓ mod dp) plus the WaS cache
  slots. The bytes are the engine's own formula (``worker/policies/sidp/ownership.py``), so the
  KV the simulator gives a replica is what the engine would have left.
- **Step time**: the TP roofline of one replica plus what reaching remote FFN weights costs:
  - WaS (§4.2): the housekeeper prefetches each remote layer's FFN shard over the intra-node link
    while earlier layers compute, so a forward pass takes max(compute, remote layers × fetch).
    Peak shifting keeps each owner serving one reader at a time, so a fetch sees the link's
    one-way bandwidth.
  - CaS (§4.3): for each remote layer the step's activations go to the owner and the FFN output
    comes back (two point-to-point messages); the owner's extra GEMM rows are, summed over the
    group, the FFN work the other replicas skip, so compute is unchanged.
  - The mode of a step is the cheaper of the two: what the group-wide controller's hysteresis
    around B_th aims at (§4.3), not its exact switching points. B_th is where the two cross.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gearshift.operator.sim.cost_model import StepCost, interpolate
from gearshift.operator.sim.hardware import Hardware, with_count
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.roofline import Layout, RooflineCost, StepShape, p2p, shape_of
from gearshift.worker.engine.scheduler import ScheduledBatch
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.policies.sidp.ownership import Ownership, WeightBytes, weight_bytes


def model_config(model: ModelDesc) -> ModelConfig:
    """The engine's config for a described model (a Llama-family decoder, untied embeddings)."""
    return ModelConfig(
        model_type="llama",
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.ffn,
        num_layers=model.layers,
        num_heads=model.heads,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=1 << 20,
    )


def shapes(model: ModelDesc, devices_per_node: int) -> Iterator[tuple[int, int]]:
    """(tp, dp) of every SiDP group that fits one node: tp divides the heads, the KV heads and
    the FFN, dp >= 2 replicas, dp x tp divides the node, and no more replicas than layers."""
    for tp in range(1, devices_per_node + 1):
        if model.heads % tp or model.kv_heads % tp or model.ffn % tp:
            continue
        for dp in range(2, devices_per_node // tp + 1):
            if devices_per_node % (dp * tp) == 0 and model.layers >= dp:
                yield tp, dp


def rank_bytes(model: ModelDesc, dp: int, tp: int, slots: int | None = None) -> WeightBytes:
    """The most any rank of the group holds (replica 0 owns the most layers when dp does not
    divide them). ``slots`` defaults to the policy's default, max(dp − 1, 1)."""
    own = Ownership(dp, model.layers)
    slots = max(dp - 1, 1) if slots is None else slots
    cfg = model_config(model)
    return max(
        (weight_bytes(cfg, own, r, slots, model.dtype_bytes, tp) for r in range(dp)),
        key=lambda w: w.resident,
    )


@dataclass(frozen=True)
class SidpCost:
    """One replica's step time in a SiDP group of ``dp`` replicas of ``tp`` ranks."""

    model: ModelDesc
    hw: Hardware
    dp: int
    tp: int

    def __post_init__(self) -> None:
        if self.dp < 2 or self.dp * self.tp > self.hw.devices_per_node:
            raise ValueError(f"sidp dp {self.dp} × tp {self.tp} must fit one node, dp >= 2")

    # Cached: the simulator asks for a step's time hundreds of thousands of times a plan.
    @functools.cached_property
    def _base(self) -> RooflineCost:
        layout = Layout("tp", self.tp) if self.tp > 1 else Layout("one")
        return RooflineCost(self.model, with_count(self.hw, self.tp), layout)

    @functools.cached_property
    def remote_layers(self) -> int:
        return self.model.layers - len(Ownership(self.dp, self.model.layers).owned(0))

    def fetch_seconds(self) -> float:
        """One remote layer's FFN shard over the intra-node link (WaS)."""
        return self._fetch

    @functools.cached_property
    def _fetch(self) -> float:
        shard = rank_bytes(self.model, self.dp, self.tp).ffn_layer
        return p2p(shard, self.hw.link_for("send_recv", 2, self.hw.intra_node))

    def was(self, s: StepShape, base: float | None = None) -> float:
        base = self._base.time(s) if base is None else base
        return max(base, self.remote_layers * self.fetch_seconds())

    def cas(self, s: StepShape, base: float | None = None) -> float:
        act = s.tokens * self.model.hidden * self.model.dtype_bytes / self.tp
        base = self._base.time(s) if base is None else base
        link = self.hw.link_for("send_recv", 2, self.hw.intra_node)
        return base + self.remote_layers * 2 * p2p(act, link)

    def time(self, s: StepShape) -> float:
        base = self._base.time(s)
        return min(self.was(s, base), self.cas(s, base))

    def step_time(self, batch: ScheduledBatch) -> float:
        return self.time(shape_of(batch))


@dataclass(frozen=True)
class MeasuredWasCost:
    """A WaS replica's step from measurements (``gearshift profile``'s ``StepCost`` of a
    one-rank engine of the same model, and the timed fetch of one remote FFN layer): every
    forward pass fetches its ``remote_layers`` again (the slots hold dp − 1 of them, §4.2).

    ``overlap``: whether the fetches run beside compute, so a pass takes max(compute, fetches),
    as on GPUs whose copies have an engine and a link of their own (``SidpCost``); or take
    their turn on the same core, so they add up, as on CPU ranks pinned to one core each, where
    the housekeeper thread shares its replica's core.
    """

    base: StepCost
    remote_layers: int
    fetch_seconds: float
    overlap: bool = False

    def step_time(self, batch: ScheduledBatch) -> float:
        compute = self.base.step_time(batch)
        fetch = self.remote_layers * self.fetch_seconds
        return max(compute, fetch) if self.overlap else compute + fetch


@dataclass(frozen=True)
class MeasuredCasCost:
    """A CaS group step from measurements (``lockstep.GroupStepCost``).

    The replicas start each step together (§4.3). In every layer each replica computes what is
    not the FFN on its own rows, at the same time as the others; the layer's owner then runs the
    FFN over every replica's rows (dummy skipping: an idle replica sends none) while the others
    wait for their slices. So a step takes the slowest replica's own step (``base``: a replica's
    measured step, its own rows through every layer), plus, for each layer that some other
    replica sends rows to, what the exchange adds: the owner's FFN over the rows it does not
    hold, the activations' trip there and back, and the waits of the lock step. That extra is
    measured on the running group (``exchange_points`` in ``benchmarks/sim_fidelity_sidp.py``),
    by the group's rows, in two cases:

    - ``shared``: the owner has rows of its own (both sides compute, the messages overlap the
      owner's work);
    - ``served``: the owner is idle (a dummy step), so the sender waits for the whole trip.

    Each is (group rows, seconds) points, read between (and beyond the last) by straight lines.

    ``alone`` (optional) is a replica's own step when no other replica computes: on hosts where
    the replicas share more than their devices (the CPU build: caches, memory bandwidth, a
    sibling hyper-thread), a replica measured beside a busy neighbour (``base``) runs slower
    than one whose neighbours idle, so a step with one busy replica is priced by ``alone``,
    and its ``served`` exchange is measured against it.
    """

    base: StepCost
    layers: int
    dp: int
    shared: tuple[tuple[int, float], ...]
    served: tuple[tuple[int, float], ...]
    alone: StepCost | None = None

    def __post_init__(self) -> None:
        for name, points in (("shared", self.shared), ("served", self.served)):
            rows = [n for n, _ in points]
            if not rows or rows != sorted(set(rows)) or min(t for _, t in points) < 0:
                raise ValueError(f"{name}: (rows, seconds) points, rows increasing, got {points}")

    def exchange_seconds(self, group_rows: int, owner_busy: bool) -> float:
        """What one layer's exchange adds to a step."""
        return interpolate(self.shared if owner_busy else self.served, group_rows, extend=True)

    def group_step_time(self, batches: Sequence[ScheduledBatch | None]) -> float:
        if len(batches) != self.dp:
            raise ValueError(f"a CaS step has {self.dp} replicas' batches, got {len(batches)}")
        rows = [b.num_tokens if b is not None else 0 for b in batches]
        busy = [b for b in batches if b is not None]
        cost = self.alone if self.alone is not None and len(busy) == 1 else self.base
        own = max((cost.step_time(b) for b in busy), default=0.0)
        owners = Ownership(self.dp, self.layers)
        extra = 0.0
        for layer in range(self.layers):
            owner = owners.owner(layer)
            if any(rows[r] for r in range(self.dp) if r != owner):
                extra += self.exchange_seconds(sum(rows), rows[owner] > 0)
        return own + extra


# B_th search bound: a step of more tokens than this is beyond any engine's batch.
MAX_B_TH = 1 << 20


@dataclass(frozen=True)
class Threshold:
    """SiDP's B_th for one shape (§4.3): the smallest batch whose forward hides WaS's fetches."""

    dp: int
    tp: int
    tokens: int | None  # decode sequences per step (None: no batch hides them)
    fetch_seconds: float  # all remote FFN layers of one forward, one after another
    forward_seconds: float  # one replica's forward at ``tokens`` (at MAX_B_TH when None)
    reason: str


def b_th(model: ModelDesc, hw: Hardware, dp: int, tp: int, context: int = 1024) -> Threshold:
    """The smallest number of decode sequences (each ``context`` tokens deep) whose TP forward
    takes at least as long as fetching the remote FFN layers: from there WaS costs nothing over
    plain TP; below it CaS is cheaper. Found by doubling, then bisection (the roofline time
    grows with the batch)."""
    cost = SidpCost(model, hw, dp, tp)
    fetch = cost.remote_layers * cost.fetch_seconds()

    def forward(b: int) -> float:
        return cost._base.time(_decode_shape(b, context))

    hi = 1
    while forward(hi) < fetch:
        if hi >= MAX_B_TH:
            return Threshold(
                dp,
                tp,
                None,
                fetch,
                forward(MAX_B_TH),
                f"even {MAX_B_TH} sequences compute faster than the fetches; WaS never hides them",
            )
        hi *= 2
    lo = hi // 2  # forward(lo) < fetch, or lo == 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if forward(mid) < fetch else (lo, mid)
    return Threshold(
        dp,
        tp,
        hi,
        fetch,
        forward(hi),
        f"{hi} sequences of {context} tokens compute {forward(hi) * 1e3:.2f} ms, the "
        f"{cost.remote_layers} remote FFN layers take {fetch * 1e3:.2f} ms to fetch",
    )


def _decode_shape(batch: int, context: int) -> StepShape:
    return StepShape(batch, float(batch * context), float(batch * context))
