"""fp32 weights on this CPU: torch's plain ``F.linear`` (MKL sgemm) vs oneDNN-packed weights, and
what the choice does to a one-rank engine's decode step.

    python benchmarks/fp32_packing.py          # → fp32_packing.json next to this file

One thread. (a) One matmul per shape and batch rows (1–8): median of 20 after warm-up. The
shapes are the LM heads of a 49,152-token vocabulary at hidden 256 and 576 (SmolLM2), and
decoder matmuls. (b) A random Llama (hidden 256, 4 layers, 49,152-token vocabulary, fp32): the
median decode step at 1, 2 and 4 sequences, with ``weight_packing`` plain and onednn, in the
same run. ``cpu_features.choose_packing`` packs fp32 where the vendor is AMD (``auto``).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_fidelity import engine_config, random_llama  # noqa: E402

SHAPES = [(49152, 256), (49152, 576), (4096, 1024), (1024, 4096), (1536, 576)]
ROWS = (1, 2, 3, 4, 8)


def _median_ms(fn, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def matmuls() -> list[dict[str, object]]:
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        for m in ROWS:
            x = torch.randn(m, k)
            plain = _median_ms(lambda x=x, w=w: F.linear(x, w))
            onednn = _median_ms(
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
            out.append({"shape": [n, k], "rows": m, "plain_ms": plain, "onednn_ms": onednn})
            print(f"{n}x{k} rows {m}: plain {plain:.3f} ms, onednn {onednn:.3f} ms", flush=True)
    return out


def decode_steps(model: str) -> list[dict[str, object]]:
    from gearshift.worker.launch import start_engine
    from gearshift.worker.sampling.params import SamplingParams

    out = []
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for packing in ("plain", "onednn"):
        engine = start_engine(engine_config(model, 1, weight_packing=packing))
        try:
            for n in (1, 2, 4):
                steps = []
                for rep in range(2):  # the first pass warms the shapes up
                    for i in range(n):
                        ids = [(7 * i + k) % 1000 for k in range(100)]
                        engine.add_request(f"{packing}-{n}-{rep}-{i}", ids, params)
                    steps.clear()
                    engine.step()  # the prefill
                    while engine.has_unfinished_requests():
                        t = time.perf_counter()
                        engine.step()
                        steps.append(time.perf_counter() - t)
                ms = statistics.median(steps) * 1e3
                out.append({"packing": packing, "sequences": n, "decode_step_ms": ms})
                print(f"engine {packing}: {n} sequences, decode step {ms:.2f} ms", flush=True)
        finally:
            engine.shutdown()
    return out


def main() -> None:
    torch.set_num_threads(1)
    report = {
        "machine": {"processor": platform.processor(), "torch": torch.__version__},
        "matmuls": matmuls(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        report["engine"] = decode_steps(str(random_llama(Path(tmp), hidden=256, layers=4)))
    (HERE / "fp32_packing.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
