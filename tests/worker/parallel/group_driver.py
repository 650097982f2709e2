"""A worker group's leader in its own process, for tests that kill ranks.

Prints ``ranks <pid> <pid> ...`` (followers 1..N-1) and ``generating`` once the group runs, then
keeps generating (new requests whenever the last ones finish, so a fast CPU cannot finish before
a test kills a rank) for ``--seconds``; on a group failure prints the engine's error and exits 4.
"""

from __future__ import annotations

import argparse
import sys
import time

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import GroupConfig, start_engine
from gearshift.worker.sampling.params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--policy-config", default='{"static": {"tp": 2}}')
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=90.0, help="generate this long, then exit 0")
    args = ap.parse_args()
    group = GroupConfig(
        timeout_s=30.0,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )
    config = EngineConfig(
        model=args.model, dtype="float32", skip_tokenizer_init=True, kv_cache_bytes=16 << 20
    )
    engine = start_engine(config, args.policy_config, group)
    print("ranks", *[p.pid for p in engine.executor.children], flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    print("generating", flush=True)
    until = time.monotonic() + args.seconds
    round_ = 0
    while time.monotonic() < until or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            for i in range(4):
                engine.add_request(f"r{round_}-{i}", [1 + i, 2, 3, 4], params)
            round_ += 1
        for out in engine.step():
            if out.finished and out.error:
                print(f"request {out.request_id} failed: {out.error}", flush=True)
        if engine.dead is not None:
            print(f"group failed: {engine.dead}", file=sys.stderr, flush=True)
            engine.shutdown()
            return 4
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
