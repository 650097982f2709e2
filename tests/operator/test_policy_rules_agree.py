"""The CRD's per-policy CEL rules and the checks the worker and operator run are one set of rules:
on random policies of every kind, each rule passes in CEL (as the API server evaluates it, on the
stored object where nothing is defaulted) exactly when it passes in Python (on the
defaults-filled message)."""

from __future__ import annotations

import random
from typing import Any

import celpy
import pytest
from google.protobuf.descriptor import FieldDescriptor

from gearshift.operator.reconcile import crd_rules
from gearshift.v1 import policy_fields
from gearshift.worker.policies import checks, kinds
from gearshift.worker.policies.policy_json import from_dict
from gearshift.worker.policies.rules import Binary, Expr, Field, G, Greatest, Not, PyEnv, same
from gearshift.worker.policies.spec import PolicySpec

CASES = 150


def _fields(expr: Expr) -> set[str]:
    if isinstance(expr, Field):
        return {expr.path}
    if isinstance(expr, Binary | Greatest):
        return _fields(expr.a) | _fields(expr.b)
    if isinstance(expr, Not):
        return _fields(expr.a)
    return set()


def _read(spec: PolicySpec) -> set[str]:
    exprs = [spec.gpus, *spec.derived.values()]
    exprs += [c.rule for c in (*spec.checks, *spec.refusals)]
    return set(spec.derived) | {f for e in exprs for f in _fields(e)}


def _random_value(field: FieldDescriptor, rng: random.Random) -> Any:
    if field.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if field.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        return rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
    lo, _ = policy_fields.bounds(field)
    return rng.randint(int(lo or 0), 9)


def _body(spec: PolicySpec, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {}
    desc = spec.message.DESCRIPTOR
    for path in sorted(_read(spec)):
        if rng.random() < 0.45:
            continue  # unset: CEL reads its default, Python fills it
        *parents, leaf = path.split(".")
        target, d = body, desc
        for name in parents:
            f = d.fields_by_name[name]
            target, d = target.setdefault(f.json_name, {}), f.message_type
        field = d.fields_by_name[leaf]
        target[field.json_name] = _random_value(field, rng)
    return body


def _python(spec: PolicySpec, body: dict[str, Any], gpus: int) -> list[bool]:
    full = checks.with_defaults(from_dict({spec.kind: body}), gpus)
    env = PyEnv(policy_fields.message_of(full), gpus)
    rules = [same(spec.gpus, G), *(c.rule for c in (*spec.checks, *spec.refusals))]
    return [bool(rule.value(env)) for rule in rules]


@pytest.mark.parametrize("kind", [s.kind for s in kinds.specs()])
def test_every_rule_passes_in_cel_exactly_when_it_passes_in_python(kind: str) -> None:
    spec = kinds.spec_of(kind)
    assert spec is not None
    env = celpy.Environment()
    programs = [env.program(env.compile(rule)) for rule, _, _ in crd_rules.spec_rules(spec)]
    rng = random.Random(kind)
    seen: set[tuple[int, bool]] = set()
    for _ in range(CASES):
        gpus = rng.randint(1, 9)
        body = _body(spec, rng)
        obj = {
            "policy": {kind: body},
            "group": {"nodes": 1, "gpusPerNode": gpus},
            "engine": "gearshift",
        }
        cel = [bool(p.evaluate({"self": celpy.json_to_cel(obj)})) for p in programs]
        python = _python(spec, body, gpus)
        assert cel == python, (body, gpus, cel, python)
        seen |= set(enumerate(python))
    # Every rule was seen both passing and failing, so agreement is not vacuous.
    assert seen == {(i, ok) for i in range(len(programs)) for ok in (False, True)}, seen
