"""A non-leader pod of a worker group, configured only by the operator's environment."""

from __future__ import annotations

import sys

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import GroupConfig, run_node
from gearshift.worker.policies.registry import make_policy


def main() -> int:
    model, policy = sys.argv[1], make_policy(sys.argv[2])
    group = GroupConfig(timeout_s=60.0).with_environment(policy.world_size)
    config = EngineConfig(
        model=model, dtype="float32", skip_tokenizer_init=True, kv_cache_bytes=32 << 20
    )
    return run_node(config, policy, group)


if __name__ == "__main__":
    sys.exit(main())
