#!/usr/bin/env bash
# Simulator fidelity out of sample for every layout and policy (issue 30, item 2), on a quiet
# machine: each script profiles once, then runs the validation traces of benchmarks/fidelity_oos.py
# (2 length mixes x offline/Poisson/Gamma CV 2.5 x 3 seeds, 24 requests each) through the engine
# and the simulator, and writes benchmarks/sim_fidelity*_oos.json. About half an hour on 2 quiet
# cores (benchmarks/README.md, "Simulator fidelity out of sample").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
B=benchmarks
run() { echo "== $*"; "$PY" "$@"; }
run $B/sim_fidelity.py --oos --out $B/sim_fidelity_oos.json
run $B/sim_fidelity.py --oos --tp 2 --out $B/sim_fidelity_tp2_oos.json
run $B/sim_fidelity.py --oos --sp 2 --out $B/sim_fidelity_sp2_oos.json
run $B/sim_fidelity.py --oos --policy shift --sp 2 --out $B/sim_fidelity_shift2_oos.json
run $B/sim_fidelity.py --oos --pp 2 --out $B/sim_fidelity_pp2_oos.json
run $B/sim_fidelity.py --oos --cpu-clock --out $B/sim_fidelity_cpu_clock_oos.json
run $B/sim_fidelity_sidp.py --oos --out $B/sim_fidelity_sidp_oos.json
run $B/sim_fidelity_sidp.py --oos --mode CAS --out $B/sim_fidelity_sidp_cas_oos.json
run $B/sim_fidelity_seesaw.py --oos --out $B/sim_fidelity_seesaw_oos.json
run $B/sim_fidelity_tetris.py --oos --out $B/sim_fidelity_tetris_oos.json
"$PY" - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("benchmarks").glob("sim_fidelity*_oos.json")):
    s = json.loads(p.read_text())["summary"]["simulated"]["all"]
    print(p.name, " ".join(f"{k}: mean {v['mean_error']:+.1%} worst {v['worst_error']:+.1%}" for k, v in s.items()))
PY
