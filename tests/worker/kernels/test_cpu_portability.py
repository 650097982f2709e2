"""Every dtype on every x86-64 CPU: weight packing and kernel ISA chosen from what the CPU has.

The choice is pure arithmetic over the CPU's flags, so it is checked for CPUs this machine is not
(Intel AMX, AMD EPYC with AVX-512 bf16 but no fp16, AVX2-only). The portable kernel builds
(AVX2, generic x86-64) are forced on whatever CPU runs the suite and checked against the torch
reference by the kernel tests themselves, in a fresh process each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gearshift.worker.kernels import build
from gearshift.worker.kernels.cpu_features import (
    ISA_ENV,
    ISA_MARCH,
    CpuFeatures,
    choose_packing,
)

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")
AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
CPUS = {
    # Intel Sapphire Rapids: AMX tiles for bf16 and fp16, AVX-512 fp16.
    "intel-amx": CpuFeatures(
        frozenset(AVX512 | {"avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16"}),
        True,
        True,
        True,
    ),
    # AMD EPYC Genoa: AVX-512 with bf16 dot products, no avx512_fp16 / avx_ne_convert.
    "amd-epyc-avx512": CpuFeatures(frozenset(AVX512 | {"avx512_bf16"}), True, True, True),
    # AVX2 only (older EPYC / client CPUs): oneDNN has no native half-precision path.
    "avx2-only": CpuFeatures(frozenset(AVX2), True, False, False),
    # Skylake-SP: AVX-512 without bf16 (torch says bf16 "supported", but only emulated).
    "intel-avx512-no-bf16": CpuFeatures(frozenset(AVX512), True, True, False),
}
EXPECTED = {  # (bf16, fp16, fp32) packing
    "intel-amx": ("onednn", "onednn", "plain"),
    "amd-epyc-avx512": ("onednn", "plain", "plain"),
    "avx2-only": ("plain", "plain", "plain"),
    "intel-avx512-no-bf16": ("plain", "plain", "plain"),
}


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_packing_is_chosen_from_the_cpu_flags(cpu):
    features = CPUS[cpu]
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    got = tuple(choose_packing(dt, CPU, "auto", features) for dt in dtypes)
    assert got == EXPECTED[cpu]
    # Without oneDNN in torch nothing is packed.
    bare = CpuFeatures(features.flags, False, False, False)
    assert {choose_packing(dt, CPU, "auto", bare) for dt in dtypes} == {"plain"}
    for dt in dtypes:
        assert choose_packing(dt, CPU, "plain", features) == "plain"


def test_forcing_onednn_where_the_cpu_cannot_run_it_is_refused_by_name():
    with pytest.raises(ValueError, match="avx512_fp16"):
        choose_packing(torch.float16, CPU, "onednn", CPUS["amd-epyc-avx512"])
    assert choose_packing(torch.float16, CPU, "onednn", CPUS["intel-amx"]) == "onednn"
    # fp32 runs packed anywhere oneDNN exists, when asked for (auto keeps it plain).
    assert choose_packing(torch.float32, CPU, "onednn", CPUS["intel-amx"]) == "onednn"
    no_onednn = CpuFeatures(CPUS["intel-amx"].flags, False, False, False)
    with pytest.raises(ValueError, match="float32"):
        choose_packing(torch.float32, CPU, "onednn", no_onednn)
    with pytest.raises(ValueError, match="not one of"):
        choose_packing(torch.bfloat16, CPU, "fastest", CPUS["intel-amx"])


def test_a_gpu_model_is_never_packed_for_onednn():
    assert choose_packing(torch.bfloat16, torch.device("cuda"), "auto", CPUS["intel-amx"]) == (
        "plain"
    )


def test_the_host_choice_is_one_its_torch_can_run():
    # On the machine running the suite: whatever auto picks must pack and multiply.
    for dt in (torch.bfloat16, torch.float16):
        if choose_packing(dt, CPU) == "onednn":
            from gearshift.worker.model.layers.linear import pack_weight, packed_linear

            w = torch.randn(64, 32).to(dt)
            x = torch.randn(4, 32).to(dt)
            got = packed_linear(x, pack_weight(w), None).float()
            torch.testing.assert_close(got, (x.float() @ w.float().T), atol=0.1, rtol=0.05)


def test_engine_config_refuses_an_unknown_packing_by_name():
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(model="m", weight_packing="fast")
    assert info.value.field == "weight_packing"


def test_fp32_packed_on_request_gives_the_plain_engines_greedy_tokens(
    tiny_checkpoint, engine_factory
):
    from gearshift.worker.sampling.params import SamplingParams

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch has no oneDNN")
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 17, 4, 99, 21], [5] * 23, [7, 8]]
    out = {}
    for packing in ("plain", "onednn"):
        engine = engine_factory(
            folder, record=False, dtype="float32", weight_packing=packing, skip_tokenizer_init=True
        )
        layer = engine.executor.gears[0].model.model.layers[0]
        assert (layer.self_attn.qkv_proj.packed is not None) == (packing == "onednn")
        out[packing] = engine.generate(prompts, params)
    for plain, packed in zip(out["plain"], out["onednn"], strict=True):
        assert packed.token_ids == plain.token_ids


def test_each_isa_has_its_own_flags_and_cache_key():
    flags = {isa: build.cflags(isa) for isa in ISA_MARCH}
    assert flags["avx2"][0] == "-march=x86-64-v3"
    assert flags["generic"][0] == "-march=x86-64-v2"
    assert "-mprefer-vector-width=512" in flags["avx512"]
    assert "-mprefer-vector-width=512" not in flags["avx2"] + flags["generic"]
    keys = {build.build_key(isa) for isa in ISA_MARCH}
    assert len(keys) == len(ISA_MARCH)


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_an_unknown_isa_falls_back_to_torch_with_a_warning(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from gearshift.worker import kernels; print(kernels.available())"
    )
    env = {
        ISA_ENV: "avx9000",
        "GEARSHIFT_KERNEL_CACHE": str(tmp_path),
        "GEARSHIFT_CPU_KERNELS": "1",
    }
    done = _run(["-c", code], env, 120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "GEARSHIFT_CPU_ISA='avx9000' is not one of" in done.stderr


# The kernel tests, plus the fused decoder layer over plain and packed weights: each compares the
# C++ kernels with the torch reference (or the Python layer, bit for bit). Every kernel the
# library exports is covered here; the SmolLM2 end-to-end backend test (test_backends_agree) adds
# no kernel and runs once, with the native build, in the main suite.
KERNEL_TESTS = [
    "tests/worker/kernels/test_elementwise.py",
    "tests/worker/kernels/test_paged_attention.py",
    "tests/worker/model/test_fused_decode.py",
]


@pytest.mark.slow
def test_two_processes_building_at_once_both_load_one_library(tmp_path, generic_kernel_cache):
    # The portable build, into the cache the next test then reuses (this file, so one xdist
    # worker: one compile, not two); a fresh cache always, or nothing would be built at once.
    cache = tmp_path if any(generic_kernel_cache.iterdir()) else generic_kernel_cache
    code = "from gearshift.worker import kernels; print(kernels.available())"
    env = {
        **os.environ,
        "GEARSHIFT_KERNEL_CACHE": str(cache),
        "GEARSHIFT_CPU_KERNELS": "1",
        ISA_ENV: "generic",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and stdout.strip() == "True", stderr[-3000:]
    key = build.build_key("generic")
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [key]
    assert (cache / key / f"{build.LIBRARY}.so").is_file()


@pytest.mark.slow
def test_kernels_built_for_the_generic_isa_match_torch(generic_kernel_cache):
    """One portable build a host. The sources branch on one ISA only (``#if __AVX512F__``): the
    native build in the main suite runs this CPU's paths (the hand-written AVX-512 ones on an
    AVX-512 CPU, the portable loops below it), and the generic build (x86-64-v2, no FMA) runs
    the portable loops on every x86 host. An AVX2 or AVX-512 build here would run code paths
    that one of the two already runs, for a minute of compiling each."""
    isa = "generic"
    cache = generic_kernel_cache
    env = {
        ISA_ENV: isa,
        "GEARSHIFT_KERNEL_CACHE": str(cache),
        "GEARSHIFT_CPU_KERNELS": "1",
    }
    done = _run(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS], env, 900)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), tail
    # A skip would mean the forced build did not load: the fixture skips kernel tests then.
    assert "skipped" not in summary, tail
    built = [p for p in cache.iterdir() if p.is_dir()]
    assert [p.name for p in built] == [build.build_key(isa)], "one library, for that ISA"


@pytest.mark.slow
def test_the_kernels_compile_as_cpp17(tmp_path):
    """torch before 2.13 builds extensions as C++17 (2.11 on the GPU machine did, and our
    kernels failed there on std::bit_cast); the sources must compile under both standards."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    flags = ["-std=c++17", "-fsyntax-only", "-fopenmp", *build.cflags("native")[:1]]
    includes = [f"-isystem{p}" for p in include_paths()]
    import sysconfig

    includes.append(f"-isystem{sysconfig.get_paths()['include']}")
    # The unit the build compiles: every source in one translation unit (torch's headers parsed
    # once, not once a source).
    unity = build.unity_source(tmp_path)
    done = subprocess.run(
        [cxx, *flags, *includes, str(unity)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"the sources are not C++17:\n{done.stderr[-3000:]}"
