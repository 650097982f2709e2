"""Property-based fuzzing of the three gRPC services with messages generated from their
descriptors (proto_strategies.py), against real servers on loopback:

- Generation and Admin: the real router (RouterServer) over scripted fake workers: the test is
  about the router's own input handling, not about generation;
- Worker: the real worker service over a real tiny engine (random weights, vocabulary 128),
  which then must have no request and no KV block left.

No call may end UNKNOWN or INTERNAL (an unexpected error, not a refusal). Bounded for CI:
derandomized (the same cases every run), a fixed number of examples, a timeout per call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gearshift.operator.router.server import load_tokenizer
from gearshift.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.fuzz.background import Background
from tests.fuzz.proto_strategies import message
from tests.router.fake_worker import Script
from tests.router.test_router_routing import running
from tests.server.test_worker_service import serving, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

EXAMPLES = 100
UNEXPECTED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
VOCAB = 128  # the tiny engine's


def _fuzz(strategy: st.SearchStrategy[Any], call: Callable[[Any], None]) -> Counter[str]:
    """Run `call` on each example; the tally of status codes it ended with."""
    seen: Counter[str] = Counter()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: Any) -> None:
        try:
            call(value)
            seen["OK"] += 1
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            seen[code.name] += 1
            assert code not in UNEXPECTED, f"{code}: {exc.details()} for\n{value}"  # type: ignore[attr-defined]

    run()
    return seen


def _clamp(sampling: Any) -> None:
    """Keep valid requests short: at most a few tokens (values stay in range)."""
    if not sampling.HasField("max_tokens") or sampling.max_tokens > 4:
        sampling.max_tokens = 4
    sampling.min_tokens = min(sampling.min_tokens, 4)


def _plausible(request: router_pb2.GenerateRequest) -> router_pb2.GenerateRequest:
    request.ClearField("model")
    if request.prompt_token_ids:
        request.ClearField("prompt")
        ids = [t % 49152 for t in request.prompt_token_ids]  # SmolLM2's vocabulary
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend(ids)
    elif not request.prompt:
        request.prompt = "hi"
    return request


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_generation_service_never_fails_unexpectedly(tokenizer: Tokenizer) -> None:
    with Background(lambda: running(tokenizer, 2)) as setup:
        for w in setup.workers:
            w.script = Script(tokens=[42, 43])
        assert setup.server.ports is not None
        with grpc.insecure_channel(f"127.0.0.1:{setup.server.ports.grpc}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)

            def generate(request: router_pb2.GenerateRequest) -> None:
                _clamp(request.sampling)
                for _ in stub.Generate(request, timeout=30):
                    pass

            requests = message(router_pb2.GenerateRequest.DESCRIPTOR)
            # Half aimed past the first checks: the served model, one kind of prompt.
            seen = _fuzz(st.one_of(requests, requests.map(_plausible)), generate)
    assert seen["OK"] and seen["INVALID_ARGUMENT"], seen


def test_admin_service_never_fails_unexpectedly(tokenizer: Tokenizer) -> None:
    with (
        Background(lambda: running(tokenizer, 2)) as setup,
        grpc.insecure_channel(setup.admin_address) as channel,
    ):
        stub = router_pb2_grpc.AdminStub(channel)
        calls = st.one_of(
            message(router_pb2.AdminApplyPolicyRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.ApplyPolicy(r, timeout=30)
            ),
            message(router_pb2.GetStatusRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.GetStatus(r, timeout=30)
            ),
            message(router_pb2.DrainRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.Drain(r, timeout=30)
            ),
        )
        seen = _fuzz(calls, lambda call: call())
    assert seen["OK"] and seen["INVALID_ARGUMENT"], seen


def _in_vocabulary(request: worker_pb2.WorkerGenerateRequest) -> worker_pb2.WorkerGenerateRequest:
    ids = [t % VOCAB for t in request.prompt_token_ids] or [1]
    del request.prompt_token_ids[:]
    request.prompt_token_ids.extend(ids)
    return request


def test_worker_service_never_fails_unexpectedly_and_leaks_nothing(tiny: Path) -> None:  # noqa: F811
    with (
        Background(lambda: serving(tiny)) as worker,
        grpc.insecure_channel(worker.address) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)

        def generate(request: worker_pb2.WorkerGenerateRequest) -> None:
            _clamp(request.sampling)
            for _ in stub.Generate(request, timeout=30):
                pass

        requests = message(worker_pb2.WorkerGenerateRequest.DESCRIPTOR)
        calls = st.one_of(
            # Half in the vocabulary, to reach past the first checks.
            st.one_of(requests, requests.map(_in_vocabulary)).map(lambda r: lambda: generate(r)),
            message(worker_pb2.AbortRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.Abort(r, timeout=30)
            ),
            message(worker_pb2.GetStatsRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.GetStats(r, timeout=30)
            ),
            message(worker_pb2.ApplyPolicyRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.ApplyPolicy(r, timeout=30)
            ),
            message(worker_pb2.ProfileTetrisRequest.DESCRIPTOR).map(
                lambda r: lambda: stub.ProfileTetris(r, timeout=30)
            ),
        )
        seen = _fuzz(calls, lambda call: call())
    # Leaving `serving` asserted that no request and no KV block is left in the engine.
    assert seen["OK"] and seen["INVALID_ARGUMENT"], seen
