"""Eq. (1) latency models of a Tetris prefill pool on specified hardware (Tetris §5.1), so
``gearshift plan`` can print the request-rate → improvement-rate table (§7.1) for GPUs we cannot
profile: the paper fits T_s = a + b·L + c·C·L + d·L² to measured (C, L) prefills per SP size;
here the samples come from the roofline instead of a measurement.

One chunk of L tokens after C history tokens on ``s`` prefill instances of TP ``tp``: the tokens
are split over the instances (zig-zag), so each computes 1/s of the chunk's weights work and of
its attention (L·C + L²/2 query-key pairs) on its TP shard; ring attention passes each
instance's K and V around the ring in s − 1 hops per layer, overlapped with the attention it
feeds (§2.3), so a layer takes the longer of the two. Not modelled: the history rebalancing
before a chunk and the KV hand-off to decode (both overlap compute in Tetris, §4.1–4.2).
"""

from __future__ import annotations

import numpy as np

from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.sim.hardware import Hardware, with_count
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.roofline import Layout, RooflineCost, StepShape, p2p

# (history C, chunk L) sample grid, tokens: chunks of 1k–32k after 0–96k of history.
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
HISTORIES = (0, 8192, 32768, 98304)


def chunk_seconds(
    model: ModelDesc, hw: Hardware, sp: int, tp: int, history: int, length: int
) -> float:
    """The roofline time of one chunk on ``sp`` instances of TP ``tp``."""
    layout = Layout("tp", tp) if tp > 1 else Layout("one")
    instance = RooflineCost(model, with_count(hw, tp), layout)
    pairs = length * history + length * length / 2
    share = StepShape(tokens=-(-length // sp), attended=pairs / sp, kv_read=(history + length) / sp)
    compute = instance.time(share)
    if sp == 1:
        return compute
    # Each hop moves one instance's K and V (its 1/sp of C + L tokens, its TP shard of heads).
    kv = model.kv_bytes_per_token() / model.layers * (history + length) / sp / tp
    ring = model.layers * (sp - 1) * p2p(kv, hw.link_for("send_recv", sp * tp))
    return max(compute, ring)


def fit(model: ModelDesc, hw: Hardware, sp: int, tp: int = 1) -> LatencyModel:
    """Least-squares Eq. (1) for SP ``sp`` over the sample grid (coefficients clipped at 0, which
    the planner's branch bound needs; a negative fit term is noise of the grid)."""
    rows, ys = [], []
    for hist in HISTORIES:
        for n in LENGTHS:
            rows.append([1.0, n, hist * n, n * n])
            ys.append(chunk_seconds(model, hw, sp, tp, hist, n))
    coef, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys), rcond=None)
    a, b, c, d = (max(float(x), 0.0) for x in coef)
    return LatencyModel(sp, a, b, c, d)


def fit_error(model: ModelDesc, hw: Hardware, fitted: LatencyModel, tp: int = 1) -> float:
    """The largest relative error of the fit over the grid."""
    worst = 0.0
    for c in HISTORIES:
        for n in LENGTHS:
            true = chunk_seconds(model, hw, fitted.sp, tp, c, n)
            worst = max(worst, abs(fitted.seconds(c, n) - true) / true)
    return worst


def prefill_tp(model: ModelDesc, hw: Hardware, share: float) -> int | None:
    """The smallest power-of-two TP within a node, splitting the heads, at which a prefill
    instance's share of the weights fits in ``share`` of a device's memory; None when none
    does."""
    tp = 1
    while tp <= hw.devices_per_node:
        fits = model.weight_bytes() / tp <= share * hw.device.memory_bytes
        if fits and not (model.heads % tp or model.kv_heads % tp) and hw.devices_per_node % tp == 0:
            return tp
        tp *= 2
    return None
