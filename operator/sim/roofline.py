"""Step time from specified hardware (issue 16, item 2): a roofline per rank plus the cost of the
layout's collectives, for one rank, TP, Ulysses SP, PP and Shift (SP for large steps, TP for small).

Per rank, compute = max(FLOPs / peak, bytes / memory bandwidth), where bytes are the rank's share
of the weights (read once per step) plus the KV it reads and writes. Collectives are priced with
the α-β model on the slowest link the group crosses: a ring all-reduce of B bytes over t ranks
costs 2(t−1)/t · B / bw + 2(t−1)·latency; an all-to-all of a rank's B bytes costs (s−1)/s · B / bw
+ (s−1)·latency. The link is the preset's, or one fitted to a profile's measured collective
(``Hardware.link_for``, links.py). Activations, norms, kernel launch overheads and compute/comm
overlap are not modelled. PP is priced as one batch's whole trip through the stages; the
simulator overlaps micro-batches when its ``Deployment`` says how many are in flight
(``micro_batches``, ``stages``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gearshift.operator.sim.cost_model import batch_features
from gearshift.operator.sim.hardware import Hardware, Link
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.worker.engine.scheduler import ScheduledBatch

KINDS = ("one", "tp", "sp", "pp", "shift")


class LayoutError(ValueError):
    """A layout does not fit the model or the hardware; the message says why."""


@dataclass(frozen=True)
class Layout:
    """``kind`` over ``degree`` ranks (``one`` has degree 1)."""

    kind: str
    degree: int = 1

    def __str__(self) -> str:
        return "one" if self.kind == "one" else f"{self.kind}{self.degree}"


def check(layout: Layout, model: ModelDesc, hw: Hardware) -> None:
    """Refuse a layout the model's heads or the hardware's device count cannot carry."""
    if layout.kind not in KINDS:
        raise LayoutError(f"layout kind {layout.kind!r} not one of {', '.join(KINDS)}")
    d = layout.degree
    if d < 1 or (layout.kind == "one" and d != 1) or d > hw.count:
        raise LayoutError(f"{layout}: needs {d} devices, the hardware has {hw.count}")
    if layout.kind in ("tp", "sp", "shift") and (model.heads % d or model.kv_heads % d):
        raise LayoutError(
            f"{layout}: {d} must divide the heads ({model.heads}) and KV heads ({model.kv_heads})"
        )
    if layout.kind == "pp" and d > model.layers:
        raise LayoutError(f"{layout}: more stages than the model's {model.layers} layers")


def all_reduce(nbytes: float, ranks: int, link: Link) -> float:
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + 2 * (ranks - 1) * link.latency


def all_to_all(nbytes: float, ranks: int, link: Link) -> float:
    """``nbytes`` is what one rank holds before the exchange."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / link.bandwidth + (ranks - 1) * link.latency


def p2p(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency


@dataclass(frozen=True)
class StepShape:
    """What a step does, independent of the layout."""

    tokens: int
    attended: float  # (query, key) pairs of attention
    kv_read: float  # KV tokens read


def shape_of(batch: ScheduledBatch) -> StepShape:
    tokens, attended = batch_features(batch)
    kv = sum(float(s.num_computed_tokens + 1) for s in batch.decodes)
    kv += sum(float(seq.num_computed_tokens + n) for seq, n in batch.prefills)
    return StepShape(tokens, attended, kv)


@dataclass(frozen=True)
class RooflineCost:
    """The simulator's step-cost interface (``step_time``) priced from a spec, not a measurement.

    ``shift_threshold``: a Shift step with at least this many tokens runs as SP, else TP; None
    picks the cheaper of the two per step (what a well-chosen threshold approximates).
    """

    model: ModelDesc
    hw: Hardware
    layout: Layout
    shift_threshold: int | None = None

    def __post_init__(self) -> None:
        check(self.layout, self.model, self.hw)

    def step_time(self, batch: ScheduledBatch) -> float:
        return self.time(shape_of(batch))

    def time(self, s: StepShape) -> float:
        kind, d = self.layout.kind, self.layout.degree
        if kind == "one":
            return self._compute(s, 1, 1, 1)
        if kind == "tp":
            return self._tp(s, d)
        if kind == "sp":
            return self._sp(s, d)
        if kind == "pp":
            return self._pp(s, d)
        if self.shift_threshold is None:
            return min(self._tp(s, d), self._sp(s, d))
        return self._sp(s, d) if s.tokens >= self.shift_threshold else self._tp(s, d)

    @functools.cached_property
    def _consts(self) -> tuple[int, int, int, int, int, int, float, float]:
        """The model's and device's figures ``_compute`` takes each step, worked out once (the
        simulator's inner loop, issue 30 item 5); integers, so every product is unchanged."""
        m = self.model
        return (
            2 * m.layers * m.layer_params(),
            2 * m.vocab * m.hidden,
            4 * m.layers,
            m.q_dim,
            m.weight_bytes(),
            m.kv_bytes_per_token(),
            self.hw.device.peak(m.flops_key),
            self.hw.device.memory_bandwidth,
        )

    def _compute(self, s: StepShape, weight_split: int, token_split: int, stages: int) -> float:
        """One rank's roofline time: its share of the weights, tokens and layers."""
        layer_flops, head_flops, attn_layers, q_dim, weights, kv_token, peak, bw = self._consts
        frac = 1.0 / stages
        tokens = math.ceil(s.tokens / token_split)  # a rank cannot process part of a token
        # 2 FLOPs per weight per token (layers, then the LM head), and 4·q_dim per attended pair
        # per layer (QKᵀ and PV), split by heads under TP and by heads across SP ranks alike.
        flops = layer_flops * frac * tokens / weight_split
        flops += head_flops * tokens / weight_split / stages
        flops += attn_layers * frac * q_dim * s.attended / (weight_split * token_split)
        kv_split = weight_split * token_split
        nbytes = weights * frac / weight_split
        nbytes += kv_token * frac * (s.kv_read + s.tokens) / kv_split
        return max(flops / peak, nbytes / bw)

    def _tp(self, s: StepShape, t: int) -> float:
        act = s.tokens * self.model.hidden * self.model.dtype_bytes
        comm = 2 * self.model.layers * all_reduce(act, t, self.hw.link_for("all_reduce", t))
        return self._compute(s, t, 1, 1) + comm

    def _sp(self, s: StepShape, sp: int) -> float:
        m = self.model
        kv_dim = m.kv_heads * m.head_dim
        local = math.ceil(s.tokens / sp) * m.dtype_bytes
        # Ulysses: q, k, v scatter heads / gather sequence before attention, the output goes back.
        widths = (m.q_dim, kv_dim, kv_dim, m.q_dim)
        link = self.hw.link_for("all_to_all", sp)
        per_layer = sum(all_to_all(local * w, sp, link) for w in widths)
        return self._compute(s, 1, sp, 1) + m.layers * per_layer

    def _pp(self, s: StepShape, p: int) -> float:
        act = s.tokens * self.model.hidden * self.model.dtype_bytes
        return p * self._compute(s, 1, 1, p) + (p - 1) * p2p(act, self.hw.link_for("send_recv", p))
