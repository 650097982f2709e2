"""A non-leader pod of a worker group, configured only by the operator's environment."""

from __future__ import annotations

import sys

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import ParallelConfig, run_node


def main() -> int:
    model, tp, sp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    parallel = ParallelConfig(tp=tp, sp=sp, timeout_s=60.0).with_environment()
    config = EngineConfig(
        model=model, dtype="float32", skip_tokenizer_init=True, kv_cache_bytes=32 << 20
    )
    return run_node(config, parallel)


if __name__ == "__main__":
    sys.exit(main())
