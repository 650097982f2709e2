"""Tetris CDSP prefill on this CPU (issue 15, Measure (b)): prefill time of long prompts on 1, 2
and 3 prefill instances and with a 2-chunk CDSP plan, against Eq. (1)'s prediction.

Eq. (1) is fitted per SP size from a profiling grid (the chunk after a history of C tokens, as
`gearshift tetris-profile` does), then a separate set of prompts is measured: one chunk on
s = 1, 2, 3 instances, and 2-chunk plans that start on 1 instance and grow to 2 or 3 (the
history is rebalanced onto the new members). Predicted = the sum of Eq. (1) over the plan's
chunks; error = (predicted − measured) / measured. Every figure comes from the same run.

Instances are gloo processes of TP 1 with the whole model, on this machine's cores (2 here, so 3
instances share 2 cores: SP 3 cannot be faster than SP 2 here). With SmolLM2 in fp32 a 2k-token
prompt already takes ~30 s on one instance; ``--random`` runs the issue's 2k–16k-token prompts
on a small random Llama instead (hidden 256, 4 layers, 8 heads, 2 KV heads: attention dominates
at these lengths, as it does for a real model at the paper's lengths), written next to the JSON.

    .venv/bin/python benchmarks/tetris_prefill.py          # writes tetris_prefill.{json,png}
    .venv/bin/python benchmarks/tetris_prefill.py --ttft [--quick]   # issue 29: TTFT of CDSP
        # with fitted models vs fixed SP 1/2/3 and single-chunk on one trace (tetris_ttft.py)
    .venv/bin/python benchmarks/tetris_prefill.py --random --lengths 1024,2048,4096 \
        --histories 0,4096 --prompts 2048,4096,8192,16384 --out benchmarks/tetris_prefill_long.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from gearshift.operator.commands.tetris_profile import fit
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.worker.launch.tetris.profile import ProfilePoints, profile_pool, time_plans
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk

HERE = Path(__file__).resolve().parent


def main() -> None:
    import sys

    if "--ttft" in sys.argv[1:]:
        # Issue 29: CDSP with fitted models vs fixed SP and single-chunk, TTFT on one trace.
        from tetris_ttft import main as ttft_main

        ttft_main([a for a in sys.argv[1:] if a != "--ttft"])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--lengths", default="512,1024,2048", help="profiling chunk lengths")
    ap.add_argument("--histories", default="0,1024", help="profiling histories")
    ap.add_argument("--prompts", default="1536,3072,4096", help="measured prompt lengths")
    ap.add_argument("--out", type=Path, default=HERE / "tetris_prefill.json")
    ap.add_argument("--random", action="store_true", help="a small random Llama instead of --model")
    args = ap.parse_args()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(","))

    from gearshift.worker.model.registry import resolve_model_path

    if args.random:
        model = str(random_llama(Path(tempfile.mkdtemp(prefix="tetris-random-"))))
        args.model = "random"
    else:
        model = str(resolve_model_path(args.model))
    load_before = os.getloadavg()
    points = ProfilePoints(ints(args.histories), ints(args.lengths))
    with tempfile.TemporaryDirectory() as tmp:
        samples = profile_pool(model, args.instances, points, Path(tmp))
    fitted = fit(samples)
    models = {m["sp"]: LatencyModel(int(m["sp"]), m["a"], m["b"], m["c"], m["d"]) for m in fitted}
    plans: list[tuple[str, int, list[PlannedChunk]]] = []
    for n in ints(args.prompts):
        for sp in range(1, args.instances + 1):
            plans.append((f"SP {sp}", n, [PlannedChunk(n, tuple(range(sp)))]))
        for sp in range(2, args.instances + 1):
            first = n // 3
            plans.append(
                (
                    f"CDSP 1→{sp}",
                    n,
                    [PlannedChunk(first, (0,)), PlannedChunk(n - first, tuple(range(sp)))],
                )
            )
    with tempfile.TemporaryDirectory() as tmp:
        seconds = time_plans(model, args.instances, [p for _, _, p in plans], Path(tmp))
    rows: list[dict[str, Any]] = []
    for (name, n, plan), measured in zip(plans, seconds, strict=True):
        predicted, done = 0.0, 0
        for chunk in plan:
            predicted += models[len(chunk.group)].seconds(done, chunk.length)
            done += chunk.length
        total = sum(measured)
        rows.append(
            {
                "plan": name,
                "prompt_tokens": n,
                "chunks": [[c.length, list(c.group)] for c in plan],
                "measured_s": round(total, 4),
                "predicted_s": round(predicted, 4),
                "error": round((predicted - total) / total, 4),
            }
        )
    result = {
        "command": "python benchmarks/tetris_prefill.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in ("out",)),
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "model": model,
        "latency_models": fitted,
        "profile_samples": {str(k): v for k, v in samples.items()},
        "prefill": rows,
    }
    print(f"{'plan':>10} | {'tokens':>6} | {'measured s':>10} | {'Eq. (1) s':>9} | error")
    for r in rows:
        print(
            f"{r['plan']:>10} | {r['prompt_tokens']:>6} | {r['measured_s']:>10} | "
            f"{r['predicted_s']:>9} | {r['error']:+.1%}"
        )
    errors = [abs(r["error"]) for r in rows]
    print(
        f"mean |error| {sum(errors) / len(errors):.1%}; fit RMS per SP:",
        {m["sp"]: round(m["fitRmsError"], 3) for m in fitted},
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print("wrote", args.out, "and", args.out.with_suffix(".png"))


def random_llama(folder: Path, **overrides: Any) -> Path:
    """A small random Llama checkpoint (safetensors + config.json) with a 32k context;
    ``overrides`` replace LlamaConfig fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
    }
    cfg = LlamaConfig(**(fields | overrides))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["plan"] for r in rows):
        mine = [r for r in rows if r["plan"] == name]
        xs = [r["prompt_tokens"] for r in mine]
        line = ax.plot(xs, [r["measured_s"] for r in mine], "o-", label=f"{name} measured")
        ax.plot(
            xs,
            [r["predicted_s"] for r in mine],
            "x--",
            color=line[0].get_color(),
            label=f"{name} Eq. (1)",
        )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill seconds")
    ax.set_title("CDSP prefill on this CPU: measured vs Eq. (1)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
