#!/usr/bin/env bash
# What a session lent a GPU machine runs (device tool, in the repository root there):
# the gpu-marked tests, then the GPU benchmarks; logs and figures land in $OUT.
#
#   bash benchmarks/gpu_check.sh            # OUT defaults to /tmp/gearshift-gpu
#
# The machine's image brings CUDA torch; the few packages it lacks travel as wheels in .whl/
# (see benchmarks/README.md). The checkout is put on the path as the `gearshift` namespace.
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
rc=0
timeout "${GPU_TEST_S:-300}" python3 -m pytest -m gpu -p no:cacheprovider --timeout 150 -q -rA \
    tests/worker/test_gpu.py tests/worker/parallel/test_layouts_gpu.py \
    tests/worker/policies/test_sidp_gpu.py tests/worker/attention/test_triton_gpu.py \
    tests/worker/policies/test_gpu_issue32.py tests/worker/p2p/test_p2p_nccl.py 2>&1 \
    | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
# The CPU kernels on that machine's compiler and torch (2.11 builds extensions as C++17).
timeout "${KERNEL_TEST_S:-240}" python3 -m pytest -p no:cacheprovider --timeout 200 -q -rfE \
    tests/worker/kernels/test_build.py tests/worker/kernels/test_elementwise.py \
    tests/worker/kernels/test_cpu_portability.py -k "not portable_isa" 2>&1 | tee "$OUT/kernels.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${GPU_BENCH_S:-150}" python3 benchmarks/sidp_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
exit "$rc"
