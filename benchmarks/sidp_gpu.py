"""SiDP Weight-as-a-Service on one GPU: does the housekeeper's prefetch hide the remote reads?

    python benchmarks/sidp_gpu.py [--out DIR]     # needs CUDA; → DIR/sidp_gpu.json

One run, one GPU, bf16, Llama-3-8B-shaped FFN layers (hidden 4096, intermediate 14336), dp = 2:
an owner process holds the FFN of the odd layers in device memory and shares them over CUDA IPC
(``DeviceSegment``); this process owns the even layers. Per batch size it times one pass of
``--layers`` FFNs (SiDP §4.2):

- ``local``: every layer's weights in this process (plain DP: each replica holds them all);
- ``was``: the odd layers through the ``Housekeeper`` (cache slots, its own stream, events),
  ``prefetch_depth`` and slots as the policy's defaults for dp 2 (1 slot) and with 2 slots;
- the copy time of one layer alone on the side stream (what the prefetch has to hide).

Figures are ratios to ``local`` measured in the same run. On one GPU the IPC read is a copy
within the same HBM, so it competes with the FFN for memory bandwidth; across GPUs it crosses
NVLink instead (the paper's setting), which this machine cannot show.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
from pathlib import Path
from typing import Any

import torch

from gearshift.worker.policies.sidp.ffn import run_ffn
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.shared_weights import DeviceSegment, FfnLayout

HERE = Path(__file__).resolve().parent


def _owner(layout: FfnLayout, layers: list[int], dtype: torch.dtype, out: Any, stop: Any) -> None:
    device = torch.device("cuda", 0)
    segs = {}
    for layer in layers:
        seg = DeviceSegment.create(f"bench-l{layer}", layout.numel, dtype, device)
        seg.tensor(dtype).normal_(0, 0.02)
        segs[layer] = seg
    torch.cuda.synchronize()
    out.put({layer: seg.address() for layer, seg in segs.items()})
    stop.wait(600)
    for seg in segs.values():
        seg.close()


def _time_pass(run: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_time(src: torch.Tensor, repeats: int) -> float:
    slot = torch.empty_like(src)
    return _time_pass(lambda: slot.copy_(src), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,8,32,128,512,2048")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    dtype, device = torch.bfloat16, torch.device("cuda", 0)
    layout = FfnLayout(args.hidden, args.inter, bias=False)
    remote = [layer for layer in range(args.layers) if layer % 2]
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_owner, args=(layout, remote, dtype, out, stop))
    proc.start()
    try:
        segs = {layer: DeviceSegment.attach(a) for layer, a in out.get(timeout=300).items()}
        sources = {layer: seg.tensor(dtype) for layer, seg in segs.items()}
        own = {
            layer: torch.empty(layout.numel, dtype=dtype, device=device).normal_(0, 0.02)
            for layer in range(args.layers)
            if layer not in sources
        }
        local_all = {**own, **{layer: src.clone() for layer, src in sources.items()}}
        copy_s = _copy_time(next(iter(sources.values())), args.repeats)
        report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "hidden": args.hidden,
            "intermediate": args.inter,
            "layers": args.layers,
            "layer_bytes": layout.numel * 2,
            "copy_one_layer_s": copy_s,
            "copy_gb_per_s": layout.numel * 2 / copy_s / 1e9,
            "rows": [],
        }
        for b in [int(v) for v in args.batches.split(",")]:
            x = torch.randn(b, args.hidden, dtype=dtype, device=device)

            def local() -> None:
                for layer in range(args.layers):
                    run_ffn(x, layout.views(local_all[layer]))  # noqa: B023

            row: dict[str, Any] = {"batch": b, "local_s": _time_pass(local, args.repeats)}
            for slots in (1, 2):
                hk = Housekeeper(
                    layout=layout,
                    num_layers=args.layers,
                    order=remote,
                    cycle_start={layer: layer - layer % 2 for layer in range(args.layers)},
                    sources=sources,
                    slots=slots,
                    prefetch_depth=slots,
                    peak_shifting=True,
                    dtype=dtype,
                    device=device,
                ).start()

                def was(hk: Housekeeper = hk) -> None:
                    for layer in range(args.layers):
                        hk.begin_layer(layer)
                        if layer in own:
                            run_ffn(x, layout.views(own[layer]))  # noqa: B023
                        else:
                            run_ffn(x, hk.acquire(layer))  # noqa: B023
                            hk.release(layer)

                try:
                    row[f"was_{slots}slot_s"] = _time_pass(was, args.repeats)
                finally:
                    hk.close()
                row[f"was_{slots}slot_over_local"] = row[f"was_{slots}slot_s"] / row["local_s"]
            row["ffn_one_layer_s"] = row["local_s"] / args.layers
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        # Drop every view of the owner's memory before it exits (torch's IPC reference counts).
        sources.clear()
        for seg in segs.values():
            seg.close()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sidp_gpu.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
