"""CEL rules of the InferenceDeployment CRD: the cross-field checks a structural schema cannot say.

The per-policy rules are rendered from each kind's spec (worker/policies/<kind>/spec.py): the same
rule objects the worker and operator evaluate in Python (worker/policies/checks.py), so the two
cannot disagree. A field reads as its default when unset, because the API server runs CEL on the
stored object, where policy defaults are not materialised.
"""

from __future__ import annotations

from typing import Any

from gearshift.worker.policies import checks, kinds
from gearshift.worker.policies.rules import CelEnv, json_path, same
from gearshift.worker.policies.rules import G as GPUS
from gearshift.worker.policies.spec import Check, PolicySpec

G = "(self.group.nodes * self.group.gpusPerNode)"


def _opt(path: str, default: str) -> str:
    """CEL for "the field, or its default when unset"."""
    head, _, leaf = path.rpartition(".")
    return f"(has({head}.{leaf}) ? {path} : {default})"


def spec_rules(spec: PolicySpec) -> list[tuple[str, str, str]]:
    """(rule, message, fieldPath) of one kind: its layout, its checks, and what the gearshift
    engine refuses (engine: vllm runs the layout itself)."""
    root = f"self.policy.{spec.kind}"
    desc = spec.message.DESCRIPTOR
    env = CelEnv(root, G, desc, spec.derived)
    guard = f"!has({root}) || "

    def where(field: str) -> str:
        return f"policy.{spec.kind}" + (f".{json_path(desc, field)}" if field else "")

    layout = Check(same(spec.gpus, GPUS), checks.layout_message(spec), spec.gpus_field)
    ruled = [(c, c.rule.cel(env)) for c in (layout, *spec.checks)]
    ruled += [(c, "self.engine == 'vllm' || " + c.rule.cel(env)) for c in spec.refusals]
    return [
        (guard + cel, f"{where(c.field)}: {c.message}", f".{where(c.field)}") for c, cel in ruled
    ]


def layout_rules() -> list[dict[str, Any]]:
    p = "self.policy"
    st = f"{p}.static"
    rules = [rule for spec in kinds.specs() for rule in spec_rules(spec)]
    rules += [
        (
            f"self.engine != 'vllm' || has({st})",
            "engine: vllm runs only the static policy",
            ".engine",
        ),
        (
            f"self.engine != 'vllm' || !has({st}) || (self.group.nodes == 1 && "
            f"{_opt(f'{st}.sp', '1')} == 1)",
            "engine: vllm runs single-node groups (group.nodes 1) without policy.static.sp",
            ".engine",
        ),
        (
            "self.model.source.startsWith('hf://') || !(has(self.model.revision) || "
            "has(self.model.hfTokenSecret) || has(self.model.cache))",
            "model.revision, model.hfTokenSecret and model.cache apply to hf:// sources only",
            ".model",
        ),
        (
            "self.engine != 'vllm' || !has(self.model.attentionBackend) || "
            "self.model.attentionBackend == 'auto'",
            "model.attentionBackend: engine vllm picks its own (auto only)",
            ".model.attentionBackend",
        ),
        (
            "self.engine == 'vllm' || has(self.images.worker)",
            "images.worker: required for engine gearshift",
            ".images",
        ),
        (
            "self.engine != 'vllm' || has(self.images.vllm)",
            "images.vllm: required for engine vllm",
            ".images",
        ),
        (
            "!has(self.router) || !has(self.router.protectMetrics) || "
            "!self.router.protectMetrics || has(self.router.apiKeySecret)",
            "router.protectMetrics: needs router.apiKeySecret (/metrics is protected by the "
            "API key)",
            ".router.protectMetrics",
        ),
    ]
    return [{"rule": r, "message": m, "fieldPath": f} for r, m, f in rules]


def add_policy_rules(schema: dict[str, Any]) -> None:
    """Attach the rules of ``auto`` (the operator plans it; it has no spec) to its schema."""
    props = schema["properties"]
    auto = props["auto"]
    auto["x-kubernetes-validations"] = [
        {"rule": "has(self.model)", "message": "model is required", "fieldPath": ".model"},
        {
            "rule": "has(self.traffic) && has(self.traffic.rate) && self.traffic.rate > 0.0",
            "message": "traffic.rate is required and must be above 0",
            "fieldPath": ".traffic.rate",
        },
    ]
    one_length = {
        "rule": "!(has(self.preset) && has(self.fixed))",
        "message": "set one of preset and fixed",
    }
    traffic = auto["properties"]["traffic"]["properties"]
    for side in ("prompt", "output"):
        traffic[side]["x-kubernetes-validations"] = [one_length]
