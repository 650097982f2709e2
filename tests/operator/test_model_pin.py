"""hf:// revisions pinned to one commit (operator/reconcile/model_pin.py), with a fake resolver:
resolved once, kept while the spec's source and revision stay, moved only when they change;
the Hub's failures refused naming spec.model.revision. The real Hub client against a local Hub
is in test_operator_hardening_kmock.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.operator.reconcile import model_pin, render_router, render_workers
from gearshift.operator.reconcile.spec import SpecError, parse

REPO = Path(__file__).resolve().parents[2]
SHA1 = "1" * 40
SHA2 = "2" * 40


class FakeHub:
    def __init__(self, refs: dict[str, str]) -> None:
        self.refs = refs
        self.calls: list[tuple[str, str]] = []

    def __call__(self, repo: str, revision: str) -> str:
        self.calls.append((repo, revision))
        if revision not in self.refs:
            raise LookupError(f"RevisionNotFound: {revision}")
        return self.refs[revision]


def _spec(**model: Any) -> Any:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / "shift.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1")
    body["spec"]["model"] = copy.deepcopy(model)
    return parse(body)


def _init_revisions(spec: Any) -> set[str]:
    pods = [
        render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"],
        render_router.deployment(spec)["spec"]["template"]["spec"],
    ]
    args = [p["initContainers"][0]["args"] for p in pods]
    return {a[a.index("--revision") + 1] for a in args}


def test_main_is_resolved_once_and_every_pod_downloads_that_commit() -> None:
    hub = FakeHub({"main": SHA1})
    pinned, status = model_pin.pin(_spec(source="hf://org/m"), None, hub)
    assert status == {"source": "hf://org/m", "revision": "main", "commit": SHA1}
    assert pinned.model.revision == SHA1 and _init_revisions(pinned) == {SHA1}
    # The next pass: the branch moved, the pin did not, and the Hub is not asked again.
    hub.refs["main"] = SHA2
    again, status2 = model_pin.pin(_spec(source="hf://org/m"), status, hub)
    assert status2 == status and again.model.revision == SHA1 and hub.calls == [("org/m", "main")]


def test_a_changed_revision_or_source_pins_afresh() -> None:
    hub = FakeHub({"main": SHA1, "v2": SHA2})
    _, status = model_pin.pin(_spec(source="hf://org/m"), None, hub)
    _, moved = model_pin.pin(_spec(source="hf://org/m", revision="v2"), status, hub)
    assert moved is not None and moved["commit"] == SHA2 and moved["revision"] == "v2"
    _, other = model_pin.pin(_spec(source="hf://org/other"), status, hub)
    assert other is not None and other["source"] == "hf://org/other"
    assert hub.calls == [("org/m", "main"), ("org/m", "v2"), ("org/other", "main")]


def test_a_commit_needs_no_hub_and_other_sources_no_pin() -> None:
    hub = FakeHub({})
    pinned, status = model_pin.pin(_spec(source="hf://org/m", revision=SHA2), None, hub)
    assert status is not None and status["commit"] == SHA2 and hub.calls == []
    assert _init_revisions(pinned) == {SHA2}
    spec = _spec(source="pvc://models/m")
    assert model_pin.pin(spec, None, hub) == (spec, None)


@pytest.mark.parametrize("answer", [LookupError("RevisionNotFound: nope"), "not-a-sha"])
def test_what_cannot_be_resolved_is_refused_naming_the_field(answer: object) -> None:
    def resolver(repo: str, revision: str) -> str:
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    with pytest.raises(SpecError, match=r"spec\.model\.revision: .*'nope'") as info:
        model_pin.pin(_spec(source="hf://org/m", revision="nope"), None, resolver)
    assert info.value.field == "spec.model.revision"
