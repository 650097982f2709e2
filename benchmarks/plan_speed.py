"""`gearshift plan`'s speed with its defaults (issue 30, item 5): a random 3-layer Qwen3
(tests/sim/fixtures/random_qwen3_3layer_config.json) on 8xH200 at 4 req/s, ShareGPT-like prompts,
300 requests a point, no SLO. Runs the command as a user does, ``--repeats`` times, and records
wall and CPU seconds (children's user + system: the machine may be shared, CPU time is what the
plan costs), peak RSS, and the report's pruned candidates and simulated points. ``--no-prune``
runs the same plan without pruning, interleaved, for the ratio.

    .venv/bin/python benchmarks/plan_speed.py                    # -> plan_speed.json
    .venv/bin/python benchmarks/plan_speed.py --no-prune --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "tests" / "sim" / "fixtures" / "random_qwen3_3layer_config.json"


def run_once(prune: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [
            sys.executable, "-m", "gearshift.operator.cli", "plan", "--model", str(MODEL),
            "--hardware", "8xH200", "--rate", "4", "--no-progress", "-o", str(out),
        ] + ([] if prune else ["--no-prune"])  # fmt: skip
        before = os.times()
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = os.times()
        data = json.loads(out.read_text())
    return {
        "prune": prune,
        "wall_s": wall,
        "cpu_s": (after.children_user - before.children_user)
        + (after.children_system - before.children_system),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "candidates": len(data["candidates"]),
        "pruned_candidates": data["pruned_candidates"],
        "simulated_points": data["simulated_points"],
        "recommended": data["recommended"],
        "ties": data["ties"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-prune", action="store_true", help="also time the unpruned plan")
    ap.add_argument("--out", type=Path, default=HERE / "plan_speed.json")
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        for prune in (True, False) if args.no_prune else (True,):
            runs.append(run_once(prune))
            r = runs[-1]
            print(
                f"run {i} prune={prune}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, "
                f"rss {r['max_rss_mb']:.0f} MB, pruned {r['pruned_candidates']} of "
                f"{r['candidates']}, {r['simulated_points']} points, -> {r['recommended']}",
                flush=True,
            )
    summary = {}
    for prune in (True, False):
        cpu = [r["cpu_s"] for r in runs if r["prune"] is prune]
        if cpu:
            summary["pruned" if prune else "unpruned"] = {
                "cpu_s_median": statistics.median(cpu), "cpu_s_min": min(cpu),
                "cpu_s_max": max(cpu),
            }  # fmt: skip
    result = {
        "command": " ".join(sys.argv),
        "case": "random 3-layer Qwen3, 8xH200, --rate 4, defaults",
        "cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
        "runs": runs,
        "summary": summary,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
