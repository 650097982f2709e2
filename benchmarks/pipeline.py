"""Pipeline vs tensor parallel on 2 ranks, and one rank, for prefill-heavy and decode-heavy work.

Seesaw's premise (§3.1) is that PP wins prefill (no per-layer all-reduce, stages overlap) and TP
wins decode (every rank works on every token, no pipeline bubble). This script measures what this
machine shows, in one run: offline tokens/s of each layout on each workload, and the mean time of
an engine step that holds prefill work vs a pure-decode step.

The model is random (SmolLM2-sized: hidden 576 would not split into 8 heads for TP, so hidden
512, 8 heads, 2 KV heads, 16 layers, SmolLM2's 49,152-token vocabulary), fp32. Each layout gets
one warm-up pass of each workload before the timed passes.

    python benchmarks/pipeline.py                 # writes pipeline.{json,png} next to this file
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
LAYOUTS = {
    "one rank": None,
    "TP 2": {"static": {"tp": 2}},
    "PP 2": {"static": {"pp": 2}},
}


def make_model(folder: Path, layers: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], int]]:
    g = torch.Generator().manual_seed(1)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(10, 49000, (length,), generator=g).tolist() for _ in range(n)]

    return {
        # arxiv-summarisation-like: long prompts, short answers.
        "prefill-heavy": (prompts(args.requests, args.long_prompt), args.short_output),
        # chat-like: short prompts, long answers.
        "decode-heavy": (prompts(args.requests, args.short_prompt), args.long_output),
    }


def run_pass(engine: Any, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    """One pass; wall time and mean time of steps with prefill work vs pure-decode steps."""
    from gearshift.worker.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    prefill_steps: list[float] = []
    decode_steps: list[float] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not outs:
            continue
        # A step whose outputs include a request's first token finished prefill work.
        (prefill_steps if any(o.num_output_tokens == 1 for o in outs) else decode_steps).append(dt)
    wall = time.perf_counter() - started
    tokens = sum(len(p) for p in prompts) + out_len * len(prompts)
    return {
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "prefill_step_ms": 1e3 * statistics.mean(prefill_steps) if prefill_steps else 0.0,
        "decode_step_ms": 1e3 * statistics.mean(decode_steps) if decode_steps else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--short-prompt", type=int, default=32)
    ap.add_argument("--short-output", type=int, default=4)
    ap.add_argument("--long-output", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "pipeline.json")
    args = ap.parse_args()

    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine

    work = workloads(args)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "model", args.layers)
        for name, policy in LAYOUTS.items():
            config = EngineConfig(
                model=str(folder),
                dtype="float32",
                skip_tokenizer_init=True,
                max_model_len=1024,
                kv_cache_bytes=1 << 30,
            )
            engine = start_engine(config, policy)
            try:
                for wname, (prompts, out_len) in work.items():
                    run_pass(engine, prompts, out_len)  # warm-up
                    passes = [run_pass(engine, prompts, out_len) for _ in range(args.passes)]
                    best = max(passes, key=lambda r: r["tokens_per_s"])
                    results.setdefault(wname, {})[name] = best
                    print(
                        f"{wname:14s} {name:9s} {best['tokens_per_s']:8.1f} tok/s  "
                        f"prefill step {best['prefill_step_ms']:7.1f} ms  "
                        f"decode step {best['decode_step_ms']:6.1f} ms",
                        flush=True,
                    )
            finally:
                engine.shutdown()
    ratios = {
        w: {
            "PP2/TP2": r["PP 2"]["tokens_per_s"] / r["TP 2"]["tokens_per_s"],
            "PP2/one": r["PP 2"]["tokens_per_s"] / r["one rank"]["tokens_per_s"],
            "TP2/one": r["TP 2"]["tokens_per_s"] / r["one rank"]["tokens_per_s"],
        }
        for w, r in results.items()
    }
    for w, r in ratios.items():
        print(w, " ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    record = {
        "command": "python benchmarks/pipeline.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(),
        },
        "results": results,
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(record, indent=2))
    plot(results, args.out.with_suffix(".png"))


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5))
    for ax, (wname, by_layout) in zip(axes, results.items(), strict=True):
        names = list(by_layout)
        ax.bar(names, [by_layout[n]["tokens_per_s"] for n in names], color=["gray", "C0", "C1"])
        ax.set_title(wname)
        ax.set_ylabel("tokens/s")
    fig.suptitle("2 CPU ranks: PP 2 vs TP 2 vs one rank (benchmarks/pipeline.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
