"""benchmarks/serve_bench.py warms up on other prompts than the ones it records."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py"


def test_the_warm_up_pass_uses_another_seed_than_the_recorded_pass(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(
        vllm_python="python", model_dir=tmp_path, input_len=128, output_len=64, num_prompts=32
    )

    def seed(cmd: list[str]) -> str:
        return cmd[cmd.index("--seed") + 1]

    recorded = bench.bench_command(args, 1, tmp_path, "x", bench.RECORDED_SEED)
    warmup = bench.bench_command(args, 1, tmp_path, "x-warmup", bench.WARMUP_SEED)
    assert seed(recorded) == str(bench.RECORDED_SEED)
    assert seed(warmup) == str(bench.WARMUP_SEED) != seed(recorded)
