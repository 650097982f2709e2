"""A Tetris group over two 'nodes' (processes here), wired only by the operator's GEARSHIFT_*
environment (Tetris §3.2: the prefill pool and the decode instances span nodes).

Node 0 hosts the endpoint and prefill instances 0 and 1; node 1 (``run_node``, as a follower pod
runs it) holds prefill instance 2 and the decode instance, whose leaders dial node 0's control
listener. A chunk's ring crosses the nodes and the KV is handed over from both: greedy tokens
equal the one-process engine's, the planner's view puts each instance on its node, and node 1's
pod exits cleanly when the group stops.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gearshift.v1 import policy_pb2
from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch import GroupConfig
from gearshift.worker.launch.tetris.start import start_tetris
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.support import check_runnable
from gearshift.worker.server import auth
from tests.worker.policies.tetris.test_tetris_group import (
    ENGINE,
    Outputs,
    _greedy,
    _plan,
    _prompts,
    _reference,
)

REPO = Path(__file__).resolve().parents[4]
TETRIS = {"prefill_instances": 3, "decode_instances": 1, "decode_tp": 1}


def _child_named(parent: int, name: str) -> int:
    """The pid of ``parent``'s descendant whose process name is ``name`` (bounded wait)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                comm = (entry / "comm").read_text().strip()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if comm == name and _descends(ppid, parent):
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"no process {name!r} under {parent}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_group_over_two_nodes_serves_one_process_tokens(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([30, 19, 25])
    expected = _reference(folder, prompts, 5)
    engine = {**ENGINE, "kv_cache_bytes": 64 << 20}
    port = _free_port()
    env = {
        "GEARSHIFT_GROUP_ADDR": "127.0.0.1",
        "GEARSHIFT_GROUP_PORT": str(port),
        "GEARSHIFT_GROUP_SIZE": "4",
        "GEARSHIFT_RANKS_PER_NODE": "2",
    }
    policy_json = json.dumps({"tetris": TETRIS})
    # Both pods hold the deployment's control token: node 1's leaders dial node 0's listener
    # with a key derived from it (launch/tetris/listener.py).
    token = auth.generate_token()
    token_file = auth.write_token(tmp_path / "control-token", token)
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.worker.parallel.node_driver",
            str(folder),
            policy_json,
            json.dumps(engine),
        ],
        cwd=REPO,
        env={
            **os.environ,
            **env,
            "GEARSHIFT_NODE_RANK": "1",
            auth.TOKEN_FILE_ENV: str(token_file),
        },
        stderr=subprocess.PIPE,
        text=True,
    )
    group = None
    try:
        leader = GroupConfig(timeout_s=60.0, control_token=token).with_environment(
            4, {**env, "GEARSHIFT_NODE_RANK": "0"}
        )
        policy = make_policy({"tetris": TETRIS})
        outputs = Outputs()
        config = EngineConfig(model=str(folder), **engine)
        group = start_tetris(config, policy, leader, outputs)  # type: ignore[arg-type]
        assert len(group.procs) == 2  # node 0's ranks only
        # The planner's view: prefill 0, 1 on node 0; prefill 2 and the decode instance on 1.
        nodes = sorted((i.role, i.index, i.node) for i in group.instances())
        assert nodes == [("decode", 0, 1), ("prefill", 0, 0), ("prefill", 1, 0), ("prefill", 2, 1)]
        plans = [
            _plan([(12, [2]), (18, [2, 0])]),  # node 1 -> a ring over both nodes
            _plan([(19, [0, 1, 2])]),  # one chunk on all three, handed over from both nodes
            _plan([(25, [1])]),  # node 0 alone, handed across
        ]
        for i, (ids, plan) in enumerate(zip(prompts, plans, strict=True)):
            group.submit(f"r{i}", ids, _greedy(5), plan)
        got = outputs.collect({f"r{i}" for i in range(3)})
        assert [got[f"r{i}"] for i in range(3)] == expected
        # Node 1's prefill instance dies: node 0 learns it from its control connection (it has
        # no process handle there), reports it down, refuses plans naming it and keeps serving.
        os.kill(_child_named(node1.pid, "gs-p2"), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while 2 not in group.dead_pool and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "control connection" in group.dead_pool[2]
        with pytest.raises(GroupFailure, match="prefill instance 2 is down"):
            group.submit("dead", prompts[0], _greedy(5), _plan([(30, [2])]))
        group.submit("alive", prompts[0], _greedy(5), _plan([(30, [0, 1])]))
        assert outputs.collect({"alive"})["alive"] == expected[0]
        slots = [m.free_slots == m.slots and m.in_transfer == 0 for m in group.managers]
        reports = group.shutdown()
        assert all(slots), "a transfer slot was left held"
        assert reports and all(r["leaked_blocks"] == 0 and r["all_free"] for r in reports)
        assert all(not p.is_alive() for p in group.procs)
        # Node 1's other ranks end with the group; its exit code is the killed rank's (-9, as
        # a process exit status 247).
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 256 - signal.SIGKILL, err[-2000:]
    finally:
        if group is not None and not group.closed:
            group.kill()
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


def test_a_decode_instance_split_over_nodes_is_refused_naming_the_field() -> None:
    # 2 prefill + TP-4 decode = 6 ranks: over 2 nodes of 3 the decode instance spans both.
    proto = policy_pb2.Policy(
        tetris=policy_pb2.TetrisPolicy(prefill_instances=2, decode_instances=1, decode_tp=4)
    )
    with pytest.raises(InvalidRequestError) as info:
        check_runnable(proto, nodes=2)
    assert info.value.field == "spec.group.nodes"
    assert "decode instance 0" in info.value.message
    # Prefill instances of TP > 1 stay whole too: one of TP 3 + 3 decode ranks over 2 nodes of 3
    # is fine; 2 of TP 3 + TP 2 over 4 nodes of 2 splits prefill instance 0 (ranks 0-2).
    whole = policy_pb2.Policy(
        tetris=policy_pb2.TetrisPolicy(
            prefill_instances=1, prefill_tp=3, decode_instances=3, decode_tp=1
        )
    )
    assert check_runnable(whole, nodes=2).kind == "tetris"
    split = policy_pb2.Policy(
        tetris=policy_pb2.TetrisPolicy(
            prefill_instances=2, prefill_tp=3, decode_instances=1, decode_tp=2
        )
    )
    with pytest.raises(InvalidRequestError, match="prefill instance 0") as info:
        check_runnable(split, nodes=4)
    assert info.value.field == "spec.group.nodes"
    # 2 prefill + 2 x TP 2 over 3 nodes of 2: each decode instance on its own node.
    ok = policy_pb2.Policy(
        tetris=policy_pb2.TetrisPolicy(prefill_instances=2, decode_instances=2, decode_tp=2)
    )
    assert check_runnable(ok, nodes=3).kind == "tetris"


def test_a_missing_node_fails_the_start_within_the_timeout_and_leaves_nothing(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    env = {
        "GEARSHIFT_GROUP_ADDR": "127.0.0.1",
        "GEARSHIFT_GROUP_PORT": str(_free_port()),
        "GEARSHIFT_GROUP_SIZE": "4",
        "GEARSHIFT_RANKS_PER_NODE": "2",
        "GEARSHIFT_NODE_RANK": "0",
    }
    leader = GroupConfig(timeout_s=3.0).with_environment(4, env)
    config = EngineConfig(model=str(folder), **ENGINE)
    before = {p.name for p in Path("/proc").iterdir() if p.name.isdigit()}
    started = time.monotonic()
    with pytest.raises(GroupFailure, match=r"ranks \[2, 3\] of the other nodes did not connect"):
        start_tetris(config, make_policy({"tetris": TETRIS}), leader, Outputs())  # type: ignore[arg-type]
    assert time.monotonic() - started < 30
    children = [
        (p / "comm").read_text().strip()
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and p.name not in before and _descends(int(p.name), os.getpid())
    ]
    assert [c for c in children if c.startswith("gs-")] == [], children
