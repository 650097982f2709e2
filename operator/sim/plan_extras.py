"""What ``gearshift plan`` prints besides its table (issue 16, item 3): SiDP's B_th for each SiDP
shape on the hardware (§4.3) and Tetris's request-rate → improvement-rate table (§5.1, §7.1) for
a prefill pool on it, with the Eq. (1) models fitted from the roofline (``tetris_models.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gearshift.operator.planner.cdsp import PlannerRules, sp_sizes
from gearshift.operator.sim import tetris_models
from gearshift.operator.sim.hardware import Hardware
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.sidp_cost import b_th
from gearshift.operator.sim.sidp_cost import shapes as sidp_shapes
from gearshift.operator.sim.tetris_rates import PoolShape, policy_rows, rate_table
from gearshift.operator.sim.traffic import Traffic

# Arrivals per request rate of the Tetris table: enough for queues to build (only the planner
# runs, so it is cheap next to the engine simulation).
TETRIS_REQUESTS = 200
# A prefill instance leaves this share of its memory for KV and activations.
PREFILL_WEIGHT_SHARE = 0.8


def sidp_thresholds(model: ModelDesc, hw: Hardware, context: int) -> list[dict[str, Any]]:
    """B_th of every SiDP shape (tp × dp, dp >= 2) that fits one node and the model's heads."""
    out = []
    for tp, dp in sidp_shapes(model, hw.devices_per_node):
        th = b_th(model, hw, dp, tp, context)
        out.append({"dp": dp, "tp": tp, "tokens": th.tokens, "reason": th.reason})
    return out


def tetris_pool(model: ModelDesc, hw: Hardware) -> dict[str, int] | None:
    """Half the devices as prefill instances of the smallest TP that holds the weights (a power
    of two dividing the heads), the other half as decode; None when no instance fits."""
    tp = tetris_models.prefill_tp(model, hw, PREFILL_WEIGHT_SHARE)
    if tp is None:
        return None
    instances = max(hw.count // 2 // tp, 1)
    decode = hw.count - instances * tp
    if decode < tp:
        return None
    return {"prefillInstances": instances, "prefillTp": tp, "decodeInstances": decode // tp,
            "decodeTp": tp}  # fmt: skip


def tetris_table(
    model: ModelDesc, hw: Hardware, traffic: Traffic, rates: Sequence[float], requests: int
) -> dict[str, Any]:
    pool = tetris_pool(model, hw)
    if pool is None:
        return {"error": f"no prefill pool of {model.name} fits {hw.count}x{hw.device.name}"}
    n, tp = pool["prefillInstances"], pool["prefillTp"]
    models = {s: tetris_models.fit(model, hw, s, tp) for s in sp_sizes(n, True)}
    rules = PlannerRules(models)
    table, _ = rate_table(
        rules, PoolShape(n, max(hw.devices_per_node // tp, 1)), traffic.prompt, rates,
        requests=requests, seed=traffic.seed,
    )  # fmt: skip
    return {
        "pool": pool,
        "latency_models": [
            {"sp": m.sp, "a": m.a, "b": m.b, "c": m.c, "d": m.d} for m in models.values()
        ],
        "fit_error": max(tetris_models.fit_error(model, hw, m, tp) for m in models.values()),
        "improvementRateTable": policy_rows(table),
    }


def text(extras: dict[str, Any]) -> str:
    lines = []
    th = extras.get("sidp_b_th")
    if th is not None:
        lines.append("SiDP B_th (decode sequences per step from which WaS hides its fetches):")
        if not th:
            lines.append("  no SiDP shape fits one node of this hardware and the model's heads")
        for row in th:
            value = "none" if row["tokens"] is None else row["tokens"]
            lines.append(f"  tp {row['tp']} x dp {row['dp']}: {value}  ({row['reason']})")
    tet = extras.get("tetris_improvement_rates")
    if tet is not None:
        if "error" in tet:
            lines.append(f"Tetris improvement rate by request rate: {tet['error']}")
        else:
            p = tet["pool"]
            lines.append(
                f"Tetris improvement rate by request rate ({p['prefillInstances']} prefill "
                f"instances of TP {p['prefillTp']}, {p['decodeInstances']} decode of TP "
                f"{p['decodeTp']}; Eq. (1) fit error {tet['fit_error']:.0%}):"
            )
            for row in tet["improvementRateTable"]:
                lines.append(f"  {row['requestRate']:g} req/s: {row['improvementRate']:g}")
    return "\n".join(lines)
