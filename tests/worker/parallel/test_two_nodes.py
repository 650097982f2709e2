"""A group spanning two 'hosts' (processes here), wired only by GEARSHIFT_* environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.worker.launch import GroupConfig
from gearshift.worker.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# TP 2 x SP 2, and TP 2 x PP 2 (each node one pipeline stage: activations cross nodes).
POLICIES = {"sp2tp2": '{"static": {"tp": 2, "sp": 2}}', "tp2pp2": '{"static": {"tp": 2, "pp": 2}}'}


@pytest.mark.parametrize("name", list(POLICIES))
def test_two_nodes_of_two_ranks_match_one_process(name, tiny_checkpoint, group_factory):
    policy = POLICIES[name]
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = group_factory(folder, None, record=False, skip_tokenizer_init=True)
    expected = [o.token_ids for o in single.generate(prompts, params)]

    port = _free_port()
    env = {
        "GEARSHIFT_GROUP_ADDR": "127.0.0.1",
        "GEARSHIFT_GROUP_PORT": str(port),
        "GEARSHIFT_GROUP_SIZE": "4",
        "GEARSHIFT_RANKS_PER_NODE": "2",
    }
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tests.worker.parallel.node_driver", str(folder), policy],
        cwd=REPO,
        env={**os.environ, **env, "GEARSHIFT_NODE_RANK": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        leader = GroupConfig(timeout_s=60.0).with_environment(
            4, {**env, "GEARSHIFT_NODE_RANK": "0"}
        )
        assert (leader.group_port, leader.node_rank, leader.local_ranks(4)) == (port, 0, 2)
        engine = group_factory(folder, policy, group=leader, record=False, skip_tokenizer_init=True)
        got = [o.token_ids for o in engine.generate(prompts, params)]
        assert got == expected
        engine.shutdown()
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 0, err[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
