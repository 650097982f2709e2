"""docs/examples/sidp.yaml as the operator renders it: its worker pod's command (`gearshift worker
--config engine.json`) hosts the SiDP replica group and answers with one rank's greedy tokens.

Adapted to this CPU: DP 4 × TP 2 on 8 GPUs becomes DP 2 × TP 2 on 4 ranks (every other field of
the example's policy as written), on a random model that speaks SmolLM2's vocabulary (SmolLM2's
3 KV heads do not split over TP 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from gearshift.operator.reconcile import render_config, render_workers
from gearshift.operator.reconcile.reconciler import runnable_spec
from gearshift.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.worker.helpers import random_model_with_smollm2_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKEN = "sidp-example-token"
PROMPTS = [[1, 2, 3, 4, 5], [7, 300, 9]]
TOKENS = 6


def _rendered(tmp: Path, model: Path) -> tuple[list[str], Path]:
    """The worker container's arguments and its engine.json, from the operator's renderers."""
    body = yaml.safe_load((REPO / "docs/examples/sidp.yaml").read_text())
    body["metadata"] = {"name": "qwen-sidp", "namespace": "ml"}
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 4}
    body["spec"]["policy"]["sidp"]["dp"] = 2
    body["spec"]["model"]["maxModelLen"] = 256  # the random model's context
    spec = runnable_spec(body)  # the operator's gate: no InvalidSpec
    container = render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"][
        "containers"
    ][0]
    cfg = render_config.engine_config(spec)
    assert cfg["policy"]["sidp"]["tp"] == 2 and cfg["group"]["gpusPerNode"] == 4
    cfg["model"]["path"] = str(model)  # stands in for the pod's model volume
    path = tmp / "engine.json"
    path.write_text(json.dumps(cfg))
    args = [str(path) if a.endswith("engine.json") else a for a in container["args"]]
    return args, path


def _reference(model: Path) -> list[list[int]]:
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine
    from gearshift.worker.sampling.params import SamplingParams

    engine = start_engine(EngineConfig(model=str(model), dtype="float32", max_model_len=256))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        return [o.token_ids for o in engine.generate(PROMPTS, params)]
    finally:
        engine.shutdown()


def _generate(stub: worker_pb2_grpc.WorkerStub, rid: str, ids: list[int]) -> list[int]:
    out: list[int] = []
    for part in stub.Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        ),
        timeout=120,
        metadata=(("authorization", f"Bearer {TOKEN}"),),
    ):
        out.extend(part.token_ids)
    return out


@pytest.mark.slow
def test_the_rendered_sidp_worker_hosts_two_tp_replicas(tmp_path: Path) -> None:
    from gearshift.worker.model.registry import resolve_model_path

    model = random_model_with_smollm2_tokenizer(tmp_path / "model", resolve_model_path("smollm2"))
    args, _ = _rendered(tmp_path, model)
    assert args[0] == "worker"
    want = _reference(model)
    ready = tmp_path / "ready.json"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        **os.environ,
        "GEARSHIFT_GROUP_NAME": "qwen-sidp-g0",
        "GEARSHIFT_CONTROL_TOKEN_FILE": str(token_file),
    }
    cmd = [sys.executable, "-m", "gearshift.operator.cli", *args]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)]
    cmd += ["--kv-cache-bytes", str(16 << 20), "--dtype", "float32"]
    cmd += ["--device", "cpu"]  # this CPU stands in for the pod's GPUs (rendered: --device cuda)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ready.is_file():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "worker not ready in time"
            time.sleep(0.2)
        port = json.loads(ready.read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            got = [_generate(stub, f"r{i}", ids) for i, ids in enumerate(PROMPTS)]
            stats = stub.GetStats(
                worker_pb2.GetStatsRequest(),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        assert got == want
        assert stats.ranks == 4
        assert (stats.policy.sidp.dp, stats.policy.sidp.tp) == (2, 2)
        figures = dict(stats.policy_stats)
        assert figures["replica1_sidp_resident_weight_bytes"] > 0, figures
        proc.terminate()
        assert proc.wait(60) == 0, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()
