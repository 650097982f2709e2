#!/usr/bin/env bash
# The packages gpu_check.sh needs that the GPU machine's image lacks (or has too old), as wheels
# for its Python 3.12 in .whl/ (git-ignored), at the versions this checkout's venv runs. The
# machine reaches no registry: run this here, before the first device call, and name .whl in
# the call's carry. gpu_check.sh installs whatever .whl holds.
#
#   bash benchmarks/gpu_wheels.sh        # -> .whl/*.whl (a few MB)
#
# What the image holds is listed in the device tool's KINDS.md. Checked by running
# calibrated_plan.py --smoke and gpu_engine.py --smoke, and collecting the gpu tests, with every
# other package the image lacks made unimportable: these three were all that was missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in protobuf llguidance gguf; do
    pins+=("$name==$(version "$name")")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "${pins[@]}"
ls -l .whl
