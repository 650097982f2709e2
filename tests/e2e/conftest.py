"""One shared `gearshift serve` (SmolLM2, shift policy, 2 groups) for the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gearshift.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.serve_process import ServeProcess

API_KEY = "test-key-e2e"
MAX_NUM_SEQS = 8
MAX_REQUESTS_PER_GROUP = 32


@pytest.fixture(scope="session")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("serve")
    proc = ServeProcess(
        tmp,
        "--model",
        "smollm2",
        "--dtype",
        "bfloat16",
        "--groups",
        "2",
        "--policy",
        "shift",
        "--sp",
        "1",
        "--tp",
        "1",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-requests-per-group",
        str(MAX_REQUESTS_PER_GROUP),
        "--max-model-len",
        "2048",
        "--kv-cache-bytes",
        str(64 << 20),
        "--api-key",
        API_KEY,
    )
    with proc:
        try:
            yield proc
        finally:
            code = proc.stop()
            log = proc.tail()
            assert code == 0, f"gearshift serve exited with {code}:\n{log}"
            assert proc.survivors() == [], "worker processes outlived gearshift serve"


# A `gearshift serve` without an API key, as an openai-http router's group (the router sends
# none): test_openai_backend_serve.py and test_schemathesis_openai.py.
@pytest.fixture(scope="session")
def openai_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        tmp_path_factory.mktemp("openai-backend"),
        "--model",
        "smollm2",
        "--served-model-name",
        "smollm2-backend",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(32 << 20),
    )
    with proc:
        yield proc
    assert proc.survivors() == []


def group_stats(serve: ServeProcess, name: str) -> worker_pb2.WorkerStats:
    """GetStats straight from a group's worker (not through the router)."""
    with grpc.insecure_channel(serve.group(name)["address"]) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(
            worker_pb2.GetStatsRequest(), timeout=5, metadata=serve.metadata
        )


def status(serve: ServeProcess) -> router_pb2.RouterStatus:
    with grpc.insecure_channel(serve.admin_address) as channel:
        return router_pb2_grpc.AdminStub(channel).GetStatus(
            router_pb2.GetStatusRequest(), timeout=5, metadata=serve.metadata
        )
