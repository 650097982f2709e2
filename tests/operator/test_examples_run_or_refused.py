"""Every docs/examples/ file either runs under `gearshift serve` or is refused with InvalidSpec.

EXAMPLES is the explicit table. An example that changes side (say static.yaml, TP 2 x PP 2,
once pipeline parallel lands and check_runnable stops refusing pp) fails the side test with a
message saying which entry to move.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, wait_for

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.reconciler import runnable_spec
from gearshift.operator.reconcile.spec import SpecError
from gearshift.v1 import common_pb2, policy_fields, router_pb2, router_pb2_grpc
from tests.e2e.serve_process import ServeProcess

REPO = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO / "docs" / "examples"
NS = "examples"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"


@dataclass(frozen=True)
class Runs:
    """Runs under `gearshift serve` on SmolLM2 (9 heads, 3 KV heads) on this CPU, adapted."""

    serve_args: tuple[str, ...]
    adaptation: str


@dataclass(frozen=True)
class Refused:
    """The reconcile pass refuses it: InvalidSpec names `field`, no child is rendered."""

    field: str


@dataclass(frozen=True)
class RenderedForVllm:
    """engine: vllm: the operator renders stock `vllm serve` pods; `gearshift serve` runs no
    vLLM engine, so it is checked at the operator only (rendered, no InvalidSpec)."""


Side = Runs | Refused | RenderedForVllm

EXAMPLES: dict[str, Side] = {
    "shift.yaml": Runs(
        ("--policy", "shift", "--sp", "3"),
        "SP 4 x TP 2 on 8 GPUs becomes SP 3 x TP 1 on 3 CPU ranks: SmolLM2's 3 KV heads allow "
        "no TP 2, and 3 ranks is what `make serve-shift` runs",
    ),
    "static.yaml": Runs(
        ("--policy-config", '{"static": {"tp": 2, "pp": 2}}'),
        "TP 2 x PP 2 as written, on 4 CPU ranks; SmolLM2's 9 heads do not split over TP 2, so "
        "tests/e2e/test_policy_config.py runs it on a random model with SmolLM2's vocabulary",
    ),
    "static-vllm.yaml": RenderedForVllm(),
    "seesaw.yaml": Runs(
        (
            "--policy-config",
            '{"seesaw": {"prefill": {"tp": 1, "pp": 3}, "decode": {"tp": 3, "pp": 1}}}',
        ),
        "PP 8 -> TP 8 on 8 GPUs becomes PP 3 -> TP 3 on 3 CPU ranks (SmolLM2's 9 heads and 3 KV "
        "heads split over 3); tests/worker/policies/test_seesaw_layouts.py runs that layout",
    ),
    "sidp.yaml": Runs(
        ("--policy-config", '{"sidp": {"dp": 2, "tp": 2}}'),
        "DP 4 x TP 2 on 8 GPUs becomes DP 2 x TP 2 on 4 CPU ranks; SmolLM2's 3 KV heads allow no "
        "TP 2, so tests/operator/test_sidp_example_worker.py runs the example's rendered worker "
        "command (and tests/e2e/test_policy_config.py `serve`) on a random model with SmolLM2's "
        "vocabulary",
    ),
    "tetris.yaml": Runs(
        (
            "--policy-config",
            '{"tetris": {"prefillInstances": 2, "decodeInstances": 1, "decodeTp": 2}}',
        ),
        "4 TP-1 prefill instances + one TP-4 decode instance on 8 GPUs become 2 + one TP-2 on 4 "
        "CPU ranks; SmolLM2's 3 KV heads allow no TP 2, so tests/e2e/test_policy_config.py serves "
        "that layout (with Eq. (1) models, so the router plans chunks) on a random model with "
        "SmolLM2's vocabulary; tests/worker/policies/tetris/test_tetris_group.py runs SmolLM2 "
        "with decode TP 1",
    ),
    "auto.yaml": Runs(
        ("--policy", "shift", "--sp", "3"),
        "auto plans Shift SP 8 for Llama-3.1-8B on 8 H100s under the example's traffic (the "
        "H100 node label below stands in for the cluster's); SP 8 becomes SP 3 on 3 CPU ranks, "
        "the layout shift.yaml's test serves; tests/operator/test_auto_resolve.py checks the plan",
    ),
}

# The cluster's nodes as the operator reads them for policy: auto without a gpu.
NODES = [
    {"metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}}
]


def _body(example: str, name: str | None = None) -> dict[str, Any]:
    body = dict(yaml.safe_load((EXAMPLES_DIR / example).read_text()))
    if name is not None:
        # kmock sets none of uid, generation, resourceVersion (kmock_harness.py).
        body["metadata"] = {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        }
    return body


def test_the_table_lists_every_example() -> None:
    on_disk = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))
    assert on_disk == sorted(EXAMPLES), "add the new docs/examples file to EXAMPLES"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_is_on_its_side_of_the_table(example: str) -> None:
    side = EXAMPLES[example]
    try:
        spec = runnable_spec(_body(example, "x"), NODES)
    except SpecError as exc:
        assert isinstance(side, Refused), (
            f"docs/examples/{example} is now refused ({exc}); EXAMPLES says {side}: fix the "
            "example or move it to the Refused side"
        )
        assert exc.field == side.field, f"refused for {exc.field}, the table says {side.field}"
        return
    if isinstance(side, Refused):
        pytest.fail(
            f"docs/examples/{example} is now runnable (check_runnable no longer refuses "
            f"{side.field}): move its EXAMPLES entry from Refused to Runs, with the "
            "`gearshift serve` flags that run its layout on SmolLM2, and update README/docs"
        )
    if isinstance(side, RenderedForVllm):
        assert spec.engine == "vllm"
    else:
        assert spec.engine == "gearshift"
        kind = policy_fields.kind_of(spec.policy)
        if side.serve_args[0] == "--policy-config":
            from gearshift.worker.policies.registry import parse_policy

            adapted = parse_policy(side.serve_args[1])
            assert policy_fields.kind_of(adapted) == kind, "the adaptation must keep the policy"
        else:
            assert side.serve_args[:2] == ("--policy", kind), "the adaptation must keep the policy"


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    """Each operator test's resources are deleted after it, so later tests do not wait on the
    operator's resync of earlier ones."""
    yield
    api.delete_all_crs(NS)


@pytest.mark.parametrize(
    "example", sorted(e for e, s in EXAMPLES.items() if not isinstance(s, Runs))
)
def test_refused_examples_get_invalid_spec_and_no_children(
    example: str,
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    one_at_a_time: None,
) -> None:
    side = EXAMPLES[example]
    name = "ex-" + example.removesuffix(".yaml")
    api.create_cr(NS, _body(example, name))
    # 60 s: the operator also resyncs this module's other resources, slowly on a loaded CPU.
    wait_for(lambda: condition(api.cr(NS, name), "InvalidSpec"), 60, what=f"{name} conditions")
    invalid = condition(api.cr(NS, name), "InvalidSpec")
    ready = condition(api.cr(NS, name), "Ready")
    if isinstance(side, RenderedForVllm):
        assert invalid["status"] == "False", invalid
        wait_for(
            lambda: api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {f"{name}-g0"},
            60,
            what="the vllm group's StatefulSet",
        )
        return
    assert isinstance(side, Refused)
    assert invalid["status"] == "True", invalid
    assert invalid["reason"] == "".join(w[0].upper() + w[1:] for w in side.field.split("."))
    assert invalid["message"].startswith(f"{side.field}: ")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert api.names(STS, {names.LABEL_DEPLOYMENT: name}) == set()
    assert api.get(f"/api/v1/namespaces/{NS}/configmaps/{name}-config") is None
    assert api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}-router") is None


# ---- a running resource edited into one the engine cannot run ---------------------------------


def test_an_edit_to_an_unrunnable_policy_is_refused_and_leaves_the_groups_alone(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, one_at_a_time: None
) -> None:
    name = "edited"
    api.create_cr(NS, _body("shift.yaml", name))
    wait_for(
        lambda: api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {f"{name}-g0", f"{name}-g1"},
        60,  # the operator also resyncs this module's other resources
        what="the shift groups",
    )
    before = {g: (api.get(f"{STS}/{g}") or {})["metadata"]["labels"] for g in (f"{name}-g0",)}
    # 8 GPUs as static TP 2 x DP 4: the schema accepts dp, the gearshift engine runs none.
    api.patch_spec(NS, name, {"policy": {"shift": None, "static": {"tp": 2, "dp": 4}}})
    wait_for(
        lambda: condition(api.cr(NS, name), "InvalidSpec").get("status") == "True",
        60,
        what="InvalidSpec after the edit",
    )
    invalid = condition(api.cr(NS, name), "InvalidSpec")
    assert invalid["reason"] == "SpecPolicyStaticDp" and invalid["observedGeneration"] == 2
    # Nothing is rolled or deleted for a spec that cannot run: the old groups keep serving.
    assert api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {f"{name}-g0", f"{name}-g1"}
    after = (api.get(f"{STS}/{name}-g0") or {})["metadata"]["labels"]
    assert after[names.LABEL_REVISION] == before[f"{name}-g0"][names.LABEL_REVISION]
    api.patch_spec(NS, name, {"policy": {"static": None, "shift": {"sp": 4, "tp": 2}}})
    wait_for(
        lambda: condition(api.cr(NS, name), "InvalidSpec").get("status") == "False",
        60,
        what="InvalidSpec cleared",
    )


# ---- the Runs side: real `gearshift serve` on SmolLM2 -----------------------------------------


# Decode steps per prompt: enough for the shift gear to run several steps on every prompt; each
# one is a 3-process all-reduce round on a 2-core CI machine.
TOKENS = 10


def makefile_args(variable: str) -> tuple[str, ...]:
    """The default of `VARIABLE ?= ...` in the Makefile: what `make serve*` passes."""
    text = (REPO / "Makefile").read_text()
    found = re.search(rf"^{variable} \?= (.*)$", text, re.MULTILINE)
    assert found, f"{variable} is not in the Makefile"
    return tuple(shlex.split(found.group(1)))


@pytest.fixture(scope="module")
def shift_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    side = EXAMPLES["shift.yaml"]
    assert isinstance(side, Runs)
    threshold = _body("shift.yaml")["spec"]["policy"]["shift"]["threshold"]
    proc = ServeProcess(
        tmp_path_factory.mktemp("serve-shift"),
        "--model",
        "smollm2",
        *side.serve_args,
        "--shift-threshold",
        str(threshold),
        # fp32 on both sides: greedy tokens are compared exactly (bf16 sums differ by layout).
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(96 << 20),
        start_timeout=420,
    )
    with proc:
        try:
            yield proc
        finally:
            code = proc.stop()
            assert code == 0, proc.tail()
            assert proc.survivors() == []


def _prompts() -> list[list[int]]:
    from gearshift.worker.model.registry import resolve_model_path
    from gearshift.worker.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model_path("smollm2"))
    chats = ["What is the capital of France?", "Name three colors of the rainbow."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    # Longer than the example's threshold (256): its prefill runs the base (SP) gear.
    long = "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 30
    prompts.append(tok.apply_chat_template([{"role": "user", "content": long}]))
    return prompts


def _generate(address: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        response = router_pb2_grpc.GenerationStub(channel).Generate(
            router_pb2.GenerateRequest(
                prompt_token_ids=ids,
                sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0),
            ),
            timeout=300,
        )
        return list(next(iter(response)).token_ids)


@pytest.mark.slow
def test_shift_example_runs_as_make_serve_shift_with_one_ranks_greedy_tokens(
    shift_server: ServeProcess,
) -> None:
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import build_local_engine
    from gearshift.worker.sampling.params import SamplingParams

    side = EXAMPLES["shift.yaml"]
    assert isinstance(side, Runs)
    assert makefile_args("SERVE_SHIFT_ARGS") == side.serve_args, (
        "`make serve-shift` must run the configuration this test checks"
    )
    prompts = _prompts()
    assert len(prompts[-1]) > 256
    served = [_generate(shift_server.grpc_address, ids) for ids in prompts]

    engine = build_local_engine(EngineConfig(model="smollm2", dtype="float32", max_model_len=1024))
    try:
        reference = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS))
    finally:
        engine.shutdown()
    assert served == [r.token_ids for r in reference]

    with grpc.insecure_channel(shift_server.admin_address) as channel:
        groups = (
            router_pb2_grpc.AdminStub(channel)
            .GetStatus(router_pb2.GetStatusRequest(), timeout=10, metadata=shift_server.metadata)
            .groups
        )
    steps = {g.name: g.steps for g in groups[0].stats.gears}
    assert steps["base"] >= 1 and steps["shift"] >= 1, steps
    assert groups[0].policy.shift.sp == 3
