#!/usr/bin/env bash
# What a session lent a GPU machine runs (device tool, in the repository root there):
# the gpu-marked tests, then the GPU benchmarks (SiDP's, the calibrated plan's, the engine's);
# logs and figures land in $OUT.
#
#   bash benchmarks/gpu_check.sh            # OUT defaults to /tmp/gearshift-gpu
#
# The whole script keeps to GPU_CHECK_S seconds (default 470, under 8 minutes): each step is cut
# at the smaller of its own cap and what is left, and gpu_engine.py starts no section it has no
# time for.
# The machine's image brings CUDA torch; the few packages it lacks travel as wheels in .whl/,
# made here beforehand by benchmarks/gpu_wheels.sh (name .whl in the device call's carry). The checkout is put on the path as the `gearshift` namespace.
set -u
OUT=${OUT:-/tmp/gearshift-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gs-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gs-site
fi
mkdir -p /tmp/gs-path/gearshift
ln -sfn "$PWD/worker" /tmp/gs-path/gearshift/worker
ln -sfn "$PWD/operator" /tmp/gs-path/gearshift/operator
ln -sfn "$PWD/proto/gearshift/v1" /tmp/gs-path/gearshift/v1
export PYTHONPATH="/tmp/gs-path:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'; } \
    2>&1 | tee "$OUT/env.txt"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_S:-470} ))
# Seconds for the next step: its cap ($1), or what is left before the deadline if less.
budget() { local left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt "$1" ] && echo $(( left > 10 ? left : 10 )) || echo "$1"; }
rc=0
timeout "$(budget "${GPU_TEST_S:-200}")" python3 -m pytest -m gpu -p no:cacheprovider --timeout 150 -q -rA \
    tests/worker/test_gpu.py tests/worker/parallel/test_layouts_gpu.py \
    tests/worker/policies/test_sidp_gpu.py tests/worker/attention/test_triton_gpu.py \
    tests/worker/policies/test_gpu_issue32.py tests/worker/p2p/test_p2p_nccl.py \
    tests/worker/test_graphs_gpu.py 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
# The fused elementwise Triton kernels against torch, compiled for this GPU.
timeout "$(budget "${FUSED_TEST_S:-60}")" python3 -m pytest -p no:cacheprovider --timeout 50 -q -rfE \
    tests/worker/model/test_fused_triton.py 2>&1 | tee "$OUT/fused.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
# The CPU kernels on that machine's compiler and torch (2.11 builds extensions as C++17).
timeout "$(budget "${KERNEL_TEST_S:-120}")" python3 -m pytest -p no:cacheprovider --timeout 110 -q -rfE \
    tests/worker/kernels/test_build.py tests/worker/kernels/test_elementwise.py \
    tests/worker/kernels/test_cpu_portability.py -k "not portable_isa" 2>&1 | tee "$OUT/kernels.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "$(budget "${GPU_BENCH_S:-60}")" python3 benchmarks/sidp_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
# The calibrated plan against the uncalibrated one on this GPU (issue 30): calibrated_plan.json.
timeout "$(budget "${GPU_PLAN_S:-150}")" python3 benchmarks/calibrated_plan.py --repeats 2 \
    --out "$OUT" 2>&1 | tee "$OUT/calibrated_plan.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
# The engine against this GPU's roofline (issue 27): gpu_engine.{json,png} in $OUT.
ENGINE_S=$(budget "${GPU_ENGINE_S:-300}")
timeout "$ENGINE_S" python3 benchmarks/gpu_engine.py --out "$OUT" --budget-s $(( ENGINE_S - 20 )) \
    2>&1 | tee "$OUT/gpu_engine.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
exit "$rc"
