"""A Seesaw group's leader in its own process, for tests that kill ranks mid-swap.

Prints ``ranks <pid> ...`` and ``generating``, then keeps prompts flowing through the host KV
store (a small one, so prompts are swapped out and in all the time); on a group failure prints
the engine's error and exits 4.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import GroupConfig, start_engine
from gearshift.worker.sampling.params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host-kv-bytes", type=int, default=28 * 2048)
    args = ap.parse_args()
    group = GroupConfig(timeout_s=30.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0)
    config = EngineConfig(
        model=args.model,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_bytes=24 * 1024,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    policy = {
        "seesaw": {
            "prefill": {"tp": 1, "pp": 2},
            "decode": {"tp": 2, "pp": 1},
            "hostKvCapacityBytes": args.host_kv_bytes,
        }
    }
    engine = start_engine(config, json.dumps(policy), group)
    print("ranks", *[p.pid for p in engine.executor.children], flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    print("generating", flush=True)
    for i in itertools.count():
        if len(engine.requests) < 12:
            engine.add_request(f"r{i}", [1 + i % 100, 2, 3, 4, 5, 6, 7, 8, 9, 10], params)
        engine.step()
        if engine.dead is not None:
            print(f"group failed: {engine.dead}", file=sys.stderr, flush=True)
            engine.shutdown()
            return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
