"""The four papers' headlines against the simulator (issue 16, "Fidelity against the papers"):
prints the table docs/planning.md shows and writes reproductions.json next to this file.

    .venv/bin/python benchmarks/reproductions.py
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from gearshift.operator.sim.reproduce import seesaw, shift, sidp, tetris

HERE = Path(__file__).resolve().parent


def main() -> None:
    start = time.perf_counter()
    rows = [*shift.reproduce(), seesaw.reproduce(), sidp.reproduce(), tetris.reproduce()]
    print(f"{'paper':<18} {'paper figure':<42} {'simulated':>10} {'band':>13}  within")
    for r in rows:
        sim = "-" if r.simulated is None else f"{r.simulated:g}"
        band = f"[{r.band[0]:g}, {r.band[1]:g}]"
        print(f"{r.paper:<18} {r.paper_figure:<42} {sim:>10} {band:>13}  {r.within}")
        print(f"{'':<18} {r.headline}; {r.unit}")
    out = [dataclasses.asdict(r) | {"within": r.within} for r in rows]
    (HERE / "reproductions.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"({time.perf_counter() - start:.1f} s; notes in reproductions.json)")


if __name__ == "__main__":
    main()
