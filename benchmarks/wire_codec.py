"""What the typed pipe codec (worker/wire.py) costs against pickle, per engine step.

    .venv/bin/python benchmarks/wire_codec.py            # → wire_codec.json

The message is the engine process's ``Outputs`` (engine_messages.py): one step's outputs of
``n`` running requests (one token each, a logprob with two alternatives on every other one)
plus the engine's stats. The child pays ``encode`` once per step (on the engine's thread), the
gRPC process ``decode``. Both codecs run on the same messages, interleaved, ``--rounds`` times;
the figures are medians with the min and max of the rounds.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.server import engine_messages as em

OUT = Path(__file__).with_suffix(".json")


def outputs(n: int) -> em.Outputs:
    """One step's message for ``n`` running requests."""
    items: list[RequestOutput | em.RequestFailed] = []
    for i in range(n):
        logprobs = [TokenLogprobs(5, -0.25, 1, ((5, -0.25), (9, -1.5)))] if i % 2 else None
        metrics = RequestMetrics(100.0 + i, 100.5 + i, 101.0 + i, None)
        items.append(
            RequestOutput(
                f"cmpl-{i:032x}", [5], " the", False, None, None, 40, i, 0, metrics, logprobs
            )
        )
    stats = EngineStats(n, 0, 4096, 900, 0.22, 40 * n, 0, 0, 1000, 40 * n, 1000)
    return em.Outputs(items, stats, None)


def _time(fn: Callable[[], Any], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 32, 256])
    args = p.parse_args()
    results: dict[str, Any] = {"command": "benchmarks/wire_codec.py", "sizes": {}}
    for n in args.sizes:
        message = outputs(n)
        wire, pickled = em.FROM_ENGINE.encode(message), pickle.dumps(message)
        assert em.FROM_ENGINE.decode(wire) == pickle.loads(pickled) == message
        repeat = max(3, 2000 // max(n, 1))
        cases = {
            "wire_encode_us": lambda m=message: em.FROM_ENGINE.encode(m),
            "pickle_encode_us": lambda m=message: pickle.dumps(m),
            "wire_decode_us": lambda b=wire: em.FROM_ENGINE.decode(b),
            "pickle_decode_us": lambda b=pickled: pickle.loads(b),
        }
        runs: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):  # interleaved: load on the machine hits both alike
            for key, fn in cases.items():
                runs[key].append(_time(fn, repeat))
        row: dict[str, Any] = {"bytes_wire": len(wire), "bytes_pickle": len(pickled)}
        for key, values in runs.items():
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for side in ("encode", "decode"):
            ratios = [
                w / q
                for w, q in zip(runs[f"wire_{side}_us"], runs[f"pickle_{side}_us"], strict=True)
            ]
            row[f"{side}_ratio"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        results["sizes"][str(n)] = row
        w, q = row["wire_encode_us"]["median"], row["pickle_encode_us"]["median"]
        er, dr = row["encode_ratio"], row["decode_ratio"]
        dw, dq = row["wire_decode_us"]["median"], row["pickle_decode_us"]["median"]
        print(
            f"n={n:4d}  encode {w:8.1f} µs (pickle {q:8.1f}, x{er['median']:.2f} "
            f"[{er['min']:.2f}-{er['max']:.2f}])  decode {dw:8.1f} µs (pickle {dq:8.1f}, "
            f"x{dr['median']:.2f} [{dr['min']:.2f}-{dr['max']:.2f}])  "
            f"bytes {len(wire)} vs {len(pickled)}"
        )
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
