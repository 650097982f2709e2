"""Tetris's KV hand-off on this CPU, whole vs layer-wise (issue 15, §4.2): time to first token of
long prompts through a real Tetris group, with the hand-off after the prefill (pieces offered,
handshaken and sent once the last chunk is done) and with ``layerwiseTransfer`` (the handshake
during the prefill, each layer's KV sent as soon as the last chunk has computed it).

One prefill instance and one decode instance of TP 1 (two gloo processes on the two cores), a
random Llama whose KV is large per token (hidden 512, 8 layers, 8 KV heads of 64: 32 KiB a
token in fp32), one request at a time, 2 output tokens. TTFT is from ``submit`` to the first
output delivered by the group; "after prefill" is TTFT less the member's own prefill seconds
(what the hand-off, the admission and the first decode step add). The two modes alternate group
by group (``--rounds``), medians per mode, every figure from the same run.

    .venv/bin/python benchmarks/tetris_handoff.py       # writes tetris_handoff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def random_llama(folder: Path) -> Path:
    """A random Llama with a large KV per token (8 layers x 8 KV heads x 64, fp32)."""
    from tetris_prefill import random_llama as build

    sizes = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8}
    return build(folder, **sizes, num_key_value_heads=8, max_position_embeddings=16384)


def run_group(
    model: str, layerwise: bool, prompts: list[list[int]], buffer_bytes: int
) -> list[dict[str, Any]]:
    """Each prompt once through a fresh group (after one untimed warm-up); per request its TTFT
    and the group's streamed-layer counters."""
    from gearshift.v1 import worker_pb2
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import GroupConfig
    from gearshift.worker.launch.tetris.start import start_tetris
    from gearshift.worker.policies.registry import make_policy
    from gearshift.worker.sampling.params import SamplingParams

    longest = max(len(p) for p in prompts)
    config = EngineConfig(
        model=model,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_bytes=(longest + 64) * 32768 * 2,
        max_model_len=longest + 64,
        max_num_batched_tokens=2048,
        num_threads=1,
    )
    policy = make_policy(
        {
            "tetris": {
                "prefill_instances": 1,
                "decode_instances": 1,
                "transfer_backends": 4,
                "transfer_buffer_bytes": buffer_bytes,
                "layerwise_transfer": layerwise,
            }
        }
    )
    firsts: queue.Queue[tuple[str, float]] = queue.Queue()
    done: queue.Queue[str] = queue.Queue()

    def deliver(rid: str, item: Any) -> None:
        if isinstance(item, BaseException):
            done.put(f"{rid} failed: {item}")
            return
        if item.new_token_ids:
            firsts.put((rid, time.perf_counter()))
        if item.finished:
            done.put(rid)

    group = start_tetris(config, policy, GroupConfig(timeout_s=600.0), deliver)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rows = []
    try:
        for i, ids in enumerate([prompts[0], *prompts]):
            rid = f"r{i}"
            plan = worker_pb2.TetrisPlan(decode_instance=0)
            plan.chunks.add(num_tokens=len(ids), prefill_instances=[0])
            before = group.stats()
            started = time.perf_counter()
            group.submit(rid, ids, params, plan)
            got, first = firsts.get(timeout=600)
            assert got == rid, (got, rid)
            finished = done.get(timeout=600)
            assert finished == rid, finished
            while not firsts.empty():  # the second token's output
                firsts.get_nowait()
            after = group.stats()
            if i == 0:
                continue  # warm-up
            rows.append(
                {
                    "layerwise": layerwise,
                    "prompt_tokens": len(ids),
                    "ttft_s": first - started,
                    "prefill_s": after["prefill_seconds_sum"] - before["prefill_seconds_sum"],
                    "streamed_layers": after["streamed_layers"] - before["streamed_layers"],
                    "streamed_layers_early": after["streamed_layers_early"]
                    - before["streamed_layers_early"],
                }
            )
    finally:
        group.shutdown()
    return rows


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompts", default="1024,2048")
    ap.add_argument("--rounds", type=int, default=3, help="groups per mode, alternating")
    ap.add_argument("--buffer-mib", type=int, default=64, help="transferBufferBytes, MiB")
    ap.add_argument("--out", type=Path, default=HERE / "tetris_handoff.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.prompts.split(",")]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_llama(Path(tmp)))
        for r in range(args.rounds):
            for layerwise in (False, True):
                got = run_group(model, layerwise, prompts, args.buffer_mib << 20)
                for row in got:
                    row["round"] = r
                    print(
                        f"round {r} {'layerwise' if layerwise else 'whole    '} "
                        f"{row['prompt_tokens']:6d} tokens: TTFT {row['ttft_s'] * 1e3:8.1f} ms, "
                        f"prefill {row['prefill_s'] * 1e3:8.1f} ms, after it "
                        f"{(row['ttft_s'] - row['prefill_s']) * 1e3:6.1f} ms, layers early "
                        f"{row['streamed_layers_early']}/{row['streamed_layers']}",
                        flush=True,
                    )
                rows += got
    summary = []
    print(
        f"\n{'tokens':>7} {'KV MiB':>7} {'TTFT whole':>11} {'layerwise':>10} {'ratio':>6}"
        f" | {'after prefill: whole':>21} {'layerwise':>10} {'ratio':>6}"
    )
    for n in lengths:
        mine = [r for r in rows if r["prompt_tokens"] == n]

        def median(layerwise: bool, key: Any, mine: list = mine) -> float:
            return statistics.median(key(r) for r in mine if r["layerwise"] == layerwise)

        w, lw = median(False, lambda r: r["ttft_s"]), median(True, lambda r: r["ttft_s"])
        tail = lambda r: r["ttft_s"] - r["prefill_s"]
        aw, alw = median(False, tail), median(True, tail)
        kv_mib = n * 32768 / (1 << 20)
        summary.append(
            {
                "prompt_tokens": n,
                "kv_mib": kv_mib,
                "whole_ttft_s": w,
                "layerwise_ttft_s": lw,
                "layerwise_over_whole": lw / w,
                "whole_after_prefill_s": aw,
                "layerwise_after_prefill_s": alw,
                "after_prefill_layerwise_over_whole": alw / aw,
            }
        )
        print(
            f"{n:7d} {kv_mib:7.0f} {w * 1e3:9.1f}ms {lw * 1e3:8.1f}ms {lw / w:6.3f}"
            f" | {aw * 1e3:19.1f}ms {alw * 1e3:8.1f}ms {alw / aw:6.3f}"
        )
    out = {
        "benchmark": "tetris_handoff",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "torch": torch.__version__,
        "model": "random Llama, hidden 512, 8 layers, 8 KV heads x 64, fp32 (32 KiB KV/token)",
        "group": "1 prefill instance + 1 decode instance, TP 1, gloo, 4 transfer slots",
        "transfer_buffer_bytes": args.buffer_mib << 20,
        "summary": summary,
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
