"""Issue 29's three comparisons projected by the simulator on the papers' hardware, beside the
papers' figures (issue 29, Measure, last bullet): prints the table benchmarks/README.md shows and
writes projections.json next to this file.

- SiDP (WaS, CaS, AUTO) vs plain DP of the same TP x DP, Llama-3.1-70B offline at S = 4K on the
  paper's H20, H200 and B200 nodes: tokens/s ratio, TPOT and KV capacity (SiDP §5.2).
- Seesaw vs the best static layout of the same 8 PCIe GPUs (A10, L4), LLaMA2-13B, prefill-heavy
  and balanced batches whose KV fills the host store twice: tokens/s ratio and transitions
  (Seesaw §6.2).
- Tetris CDSP vs every fixed SP and single-chunk, LLaMA3-8B on 16 A100 prefill instances, Long
  trace: TTFT p50/p99 (Tetris §7.3).

Each is priced twice: "scaled", the preset times the efficiencies fitted to the recorded GPU run
(``operator/sim/pricing.py``), and "datasheet", the preset as specified; Tetris also with the
paper's own Table 1 latencies ("table1"). The code is ``operator/sim/reproduce/`` (``project*``).

    .venv/bin/python benchmarks/projections.py            # all (a few minutes on 2 cores)
    .venv/bin/python benchmarks/projections.py --only sidp      # → projections_sidp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from gearshift.operator.sim.reproduce import seesaw, sidp, tetris
from gearshift.operator.sim.reproduce.common import PRICINGS, Projection

HERE = Path(__file__).resolve().parent


def sidp_jobs() -> list[tuple[Callable[..., Projection], tuple[Any, ...]]]:
    # WaS and CaS held are priced on the paper's main testbed (H20, Fig. 11, 13, 15); the other
    # nodes run AUTO only, to keep the script within minutes.
    return [
        (sidp.project, (hw, p, hw == "H20")) for hw in ("H20", "H200", "B200") for p in PRICINGS
    ]


def seesaw_jobs() -> list[tuple[Callable[..., Projection], tuple[Any, ...]]]:
    return [
        (seesaw.project_pressure, (gpu, workload, p))
        for gpu in ("A10", "L4")
        for workload in seesaw.PRESSURE_WORKLOADS
        for p in PRICINGS
    ]


def tetris_jobs() -> list[tuple[Callable[..., Projection], tuple[Any, ...]]]:
    return [(tetris.project_ttft, (p, load)) for p in tetris.TTFT_PRICINGS for load in tetris.LOADS]


PARTS = {"sidp": sidp_jobs, "seesaw": seesaw_jobs, "tetris": tetris_jobs}


def _call(job: tuple[Callable[..., Projection], tuple[Any, ...]]) -> Projection:
    return job[0](*job[1])


def _extra(r: Projection) -> str:
    """The comparison's second figures: TPOT and KV (SiDP), transitions (Seesaw), p99 and
    single-chunk (Tetris)."""
    f: dict[str, Any] = r.figures
    if r.paper == "SiDP":
        modes = ", ".join(f"{k[5:]} {v:.2f}x" for k, v in f["tokens_per_s_ratio"].items())
        tpot = f["SiDP AUTO"]["tpot_p50_s"] / f["plain DP"]["tpot_p50_s"]
        return f"{modes}; TPOT p50 {tpot:.2f}x; KV {f['kv_ratio']:.2f}x"
    if r.paper == "Seesaw":
        best = f["candidates"][f["best_seesaw"]]
        workload = next(w for w in seesaw.PRESSURE_WORKLOADS if w in r.comparison)
        return (
            f"{workload}: {f['best_seesaw']} vs {f['best_static']}; "
            f"transitions {best['transitions']} (min {best['min_transitions']})"
        )
    return (
        f"load {f['load']:g}, {f['rate_req_s']:.3g} req/s; "
        f"p99 {f['best_fixed_p99_over_cdsp']:.2f}x; single-chunk p50 "
        f"{f['single_chunk_p50_over_cdsp']:.2f}x p99 {f['single_chunk_p99_over_cdsp']:.2f}x"
    )


def _load(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in d.items() if k != "within"} for d in json.loads(path.read_text())]


def _print(rows: list[Projection]) -> None:
    print(f"{'paper':<7} {'hardware':<22} {'pricing':<9} {'simulated':>9}  {'metric':<40} extra")
    for r in rows:
        print(
            f"{r.paper:<7} {r.hardware[:22]:<22} {r.pricing:<9} {r.simulated:>8.3g}x  "
            f"{r.metric[:40]:<40} {_extra(r)}"
        )
    for paper in dict.fromkeys(r.paper for r in rows):
        first = next(r for r in rows if r.paper == paper)
        print(f"{paper}, the paper: {first.paper_figure}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(PARTS), action="append", help="repeatable")
    ap.add_argument(
        "--out", type=Path, help="default projections.json (with --only: projections_<parts>.json)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--table-only", action="store_true", help="print --out's table, no runs")
    args = ap.parse_args()
    if args.out is None:  # a partial run never overwrites the full one
        parts = "_".join(sorted(args.only)) if args.only else ""
        args.out = HERE / (f"projections_{parts}.json" if parts else "projections.json")
    if args.table_only:
        rows = [Projection(**(d | {"band": tuple(d["band"])})) for d in _load(args.out)]
        _print(rows)
        return
    start = time.perf_counter()
    jobs = [job for name in args.only or list(PARTS) for job in PARTS[name]()]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(_call, jobs))
    _print(rows)
    out = [dataclasses.asdict(r) | {"within": r.within} for r in rows]
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"({time.perf_counter() - start:.1f} s; setups and notes in {args.out.name})")


if __name__ == "__main__":
    main()
