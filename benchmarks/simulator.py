"""The simulator's speed and `gearshift plan`'s worked example (issue 16, Measure).

1. Speed: simulated requests per second of wall time, and wall seconds per candidate × rate
   point, for ShareGPT-like traffic on Llama-3-8B / 8xH200 (TP 8, one group).
2. `gearshift plan` (the library the command runs) for Llama-3-8B and Llama-3-70B (their
   published config.json shapes, tests/sim/fixtures/) on 8xH200 and 8xL4 with bursty ShareGPT-like
   traffic (Gamma arrivals, CV 2) and an SLO of TTFT 2 s, TPOT 100 ms: every candidate's figures
   at the declared rate, the highest rate meeting the SLO, and the recommendation.

The fidelity table (predicted vs measured on this machine) is ``sim_fidelity.py``.

    .venv/bin/python benchmarks/simulator.py      # → simulator.json, a few minutes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.candidates import PlanSettings, enumerate_candidates
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.planning import plan_deployment
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.traffic import Traffic

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "sim" / "fixtures"
CASES = [
    ("llama3_8b_config.json", "8xH200", 8.0),
    ("llama3_8b_config.json", "8xL4", 2.0),
    ("llama3_70b_config.json", "8xH200", 2.0),
    ("llama3_70b_config.json", "8xL4", 0.5),
]
SLO = "ttft:2000 tpot:100"


def speed(requests: int) -> dict[str, float]:
    model = model_desc.load(FIXTURES / "llama3_8b_config.json")
    cand = next(
        c
        for c in enumerate_candidates(model, hardware.load("8xH200"), PlanSettings())
        if c.name == "tp8"
    )
    traffic = Traffic.from_mapping(
        {"rate": 20, "burstiness": 2, "prompt": {"preset": "sharegpt"}, "requests": requests}
    )
    trace = traffic.trace()
    start = time.perf_counter()
    simulate(Deployment(1, cand.config, cand.cost), trace)
    wall = time.perf_counter() - start
    return {"requests": requests, "wall_s": wall, "requests_per_wall_s": requests / wall}


def plan_case(config: str, hw: str, rate: float, requests: int) -> dict[str, Any]:
    traffic = Traffic.from_mapping(
        {"rate": rate, "burstiness": 2, "prompt": {"preset": "sharegpt"}, "requests": requests}
    )
    start = time.perf_counter()
    report = plan_deployment(
        model_desc.load(FIXTURES / config), hardware.load(hw), traffic, Goodput.parse(SLO)
    )
    wall = time.perf_counter() - start
    data = report.to_json()
    points = sum(len(c["points"]) for c in data["candidates"])
    data.update(model=config, hardware=hw, wall_s=wall, points=points)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per simulated point")
    ap.add_argument("--out", type=Path, default=HERE / "simulator.json")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "command": f"python benchmarks/simulator.py --requests {args.requests}"
    }
    result["speed"] = speed(1000)
    s = result["speed"]
    print(
        f"speed: {s['requests']} requests in {s['wall_s']:.2f} s "
        f"= {s['requests_per_wall_s']:.0f} req/s"
    )
    result["plans"] = []
    for config, hw, rate in CASES:
        data = plan_case(config, hw, rate, args.requests)
        result["plans"].append(data)
        print(
            f"\n{config} on {hw}, {rate:g} req/s (CV 2, sharegpt), SLO {SLO}: "
            f"{data['points']} points in {data['wall_s']:.1f} s "
            f"({data['wall_s'] / max(1, data['points']):.2f} s per point)"
        )
        print(
            f"{'candidate':>10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} "
            f"{'out tok/s':>9} {'KV tok':>9} {'max rate':>8}"
        )
        for c in data["candidates"]:
            at = next((p for p in c["points"] if p["declared"]), None)
            if c["error"] or not at or not at.get("requests"):
                print(f"{c['name']:>10} {c['error'] or 'no result'}")
                continue
            mr = c["max_rate_meeting_slo"]
            top = ">=" if c["max_rate_at_sweep_top"] else ""
            print(
                f"{c['name']:>10} {at['ttft_p50_s']:>9.3f} {at['ttft_p99_s']:>8.3f} "
                f"{at['tpot_p50_s']:>9.4f} {at['tpot_p99_s']:>8.4f} "
                f"{at['output_tokens_per_s']:>9.0f} {c['kv_tokens_per_group']:>9} "
                f"{'-' if mr is None else f'{top}{mr:g}':>8}"
            )
        print(f"recommended: {data['recommended']} — {data['reason']}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
