"""Seesaw (P2 prefill -> T2 decode) vs static TP 2, PP 2 and one rank, offline, on 2 CPU ranks.

Two workloads: prefill-heavy (arxiv-summarisation-like lengths: long prompts, short outputs) and
balanced (ShareGPT-like: prompts and outputs of similar, varied lengths). For Seesaw the step
time is split by phase (prefill / decode), and the re-shard and swap seconds and the number of
transitions come from the policy's stats. Same random model as benchmarks/pipeline.py (fp32).

    python benchmarks/seesaw.py                  # writes seesaw.{json,png} next to this file
    python benchmarks/seesaw.py --pressure       # host-store pressure (seesaw_pressure.py)
    python benchmarks/seesaw.py --pressure --quick   # the same, small: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pipeline import make_model  # noqa: E402 - the sibling benchmark's model

LAYOUTS: dict[str, Any] = {
    "one rank": None,
    "TP 2": {"static": {"tp": 2}},
    "PP 2": {"static": {"pp": 2}},
    "Seesaw P2->T2": {
        "seesaw": {
            "prefill": {"tp": 1, "pp": 2},
            "decode": {"tp": 2, "pp": 1},
            "hostKvCapacityBytes": 256 << 20,
        }
    },
}


def workloads(args: argparse.Namespace) -> dict[str, list[tuple[list[int], int]]]:
    g = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, 49000, (n,), generator=g).tolist()

    def around(mean: int) -> int:
        return max(4, int(mean * (0.5 + torch.rand((), generator=g).item())))

    return {
        "prefill-heavy": [
            (prompt(around(args.long_prompt)), args.short_output) for _ in range(args.requests)
        ],
        "balanced": [
            (prompt(around(args.balanced_len)), around(args.balanced_len))
            for _ in range(args.requests)
        ],
    }


def run_pass(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    """One pass: tokens/s and, for Seesaw, seconds per phase, re-shard, swap and transitions."""
    from seesaw_pressure import drive

    before = dict(engine.stats().policy_stats)
    wall, phase = drive(engine, work, "r")
    after = engine.stats().policy_stats
    tokens = sum(len(p) + n for p, n in work)
    out = {"seconds": wall, "tokens_per_s": tokens / wall}
    if after:
        out.update(
            prefill_seconds=phase["prefill"][0],
            decode_seconds=phase["decode"][0],
            reshard_seconds=after["reshard_seconds"] - before.get("reshard_seconds", 0.0),
            # The engine's time with nothing to run but swap-ins outstanding (wall time lost);
            # swap_wait_seconds sums every sequence's wait, which overlaps other work.
            swap_wait_seconds=after["swap_stall_seconds"] - before.get("swap_stall_seconds", 0.0),
            transitions=after["transitions"] - before.get("transitions", 0.0),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--short-output", type=int, default=8)
    ap.add_argument("--balanced-len", type=int, default=96)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--pressure", action="store_true", help="device KV and host store < work")
    ap.add_argument("--quick", action="store_true", help="--pressure, small sizes")
    ap.add_argument("--repetitions", type=int, default=3, help="--pressure: interleaved")
    ap.add_argument("--device-kv-tokens", type=int, default=2048, help="--pressure, per rank")
    ap.add_argument("--host-kv-tokens", type=int, default=4096, help="--pressure")
    ap.add_argument("--batched-tokens", type=int, default=512, help="--pressure")
    ap.add_argument("--note", default="", help="--pressure: saved in the JSON")
    args = ap.parse_args()
    if args.quick:
        args.pressure = True
        args.requests, args.long_prompt, args.short_output, args.balanced_len = 12, 64, 4, 24
        args.layers, args.device_kv_tokens, args.host_kv_tokens = 2, 256, 384
        args.batched_tokens = 128
    if args.pressure:
        from seesaw_pressure import run_pressure

        name = "seesaw_pressure_quick.json" if args.quick else "seesaw_pressure.json"
        run_pressure(args, make_model, workloads, args.out or HERE / name)
        return
    args.out = args.out or HERE / "seesaw.json"

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
                kv_cache_bytes=256 << 20,
                enable_prefix_caching=False,
            )
            engine = start_engine(config, policy)
            try:
                for wname, items in work.items():
                    run_pass(engine, items)  # warm-up
                    passes = [run_pass(engine, items) for _ in range(args.passes)]
                    best = max(passes, key=lambda r: r["tokens_per_s"])
                    results.setdefault(wname, {})[name] = best
                    extra = ""
                    if "transitions" in best:
                        extra = (
                            f"  prefill {best['prefill_seconds']:.2f}s"
                            f" decode {best['decode_seconds']:.2f}s"
                            f" re-shard {best['reshard_seconds']:.2f}s "
                            f"swap {best['swap_wait_seconds']:.2f}s "
                            f"transitions {best['transitions']:.0f}"
                        )
                    print(f"{wname:14s} {name:14s} {best['tokens_per_s']:8.1f} tok/s{extra}")
            finally:
                engine.shutdown()
    ratios = {
        w: {
            f"Seesaw/{k}": r["Seesaw P2->T2"]["tokens_per_s"] / r[k]["tokens_per_s"]
            for k in ("one rank", "TP 2", "PP 2")
        }
        for w, r in results.items()
    }
    for w, r in ratios.items():
        print(w, " ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    record = {
        "command": "python benchmarks/seesaw.py "
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

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8))
    for ax, (wname, by_layout) in zip(axes, results.items(), strict=True):
        names = list(by_layout)
        ax.bar(
            names, [by_layout[n]["tokens_per_s"] for n in names], color=["gray", "C0", "C1", "C2"]
        )
        ax.set_title(wname)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("2 CPU ranks: Seesaw vs static layouts (benchmarks/seesaw.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
