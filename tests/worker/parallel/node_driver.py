"""A non-leader pod of a worker group, configured only by the operator's environment (the
control token, as a pod gets it, from the file ``$GEARSHIFT_CONTROL_TOKEN_FILE`` names)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import GroupConfig
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.server import auth
from gearshift.worker.server.runtimes import run_group_node


def main() -> int:
    """argv: model folder, policy JSON, and optionally EngineConfig overrides as JSON."""
    model, policy = sys.argv[1], make_policy(sys.argv[2])
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    group = GroupConfig(timeout_s=60.0).with_environment(policy.world_size)
    token_file = os.environ.get(auth.TOKEN_FILE_ENV)
    if token_file:
        group = replace(group, control_token=auth.read_token(token_file))
    engine = {"dtype": "float32", "skip_tokenizer_init": True, "kv_cache_bytes": 32 << 20}
    config = EngineConfig(model=model, **{**engine, **extra})
    return run_group_node(config, policy, group)


if __name__ == "__main__":
    sys.exit(main())
