"""A group spanning two 'hosts' (processes here), wired only by GEARSHIFT_* environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from gearshift.worker.launch import ParallelConfig
from gearshift.worker.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_of_two_ranks_match_one_process(tiny_checkpoint, group_factory):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = group_factory(folder, ParallelConfig(), record=False, skip_tokenizer_init=True)
    expected = [o.token_ids for o in single.generate(prompts, params)]

    port = _free_port()
    env = {
        "GEARSHIFT_GROUP_ADDR": "127.0.0.1",
        "GEARSHIFT_GROUP_PORT": str(port),
        "GEARSHIFT_GROUP_SIZE": "4",
        "GEARSHIFT_RANKS_PER_NODE": "2",
    }
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tests.worker.parallel.node_driver", str(folder), "2", "2"],
        cwd=REPO,
        env={**os.environ, **env, "GEARSHIFT_NODE_RANK": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        leader = ParallelConfig(tp=2, sp=2, timeout_s=60.0).with_environment(
            {**env, "GEARSHIFT_NODE_RANK": "0"}
        )
        assert (leader.group_port, leader.node_rank, leader.local_ranks) == (port, 0, 2)
        engine = group_factory(folder, leader, record=False, skip_tokenizer_init=True)
        got = [o.token_ids for o in engine.generate(prompts, params)]
        assert got == expected
        engine.shutdown()
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 0, err[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
