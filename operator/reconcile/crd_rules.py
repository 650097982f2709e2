"""CEL rules of the InferenceDeployment CRD: the cross-field checks a structural schema cannot say.

Each layout rule mirrors `policy_fields.layout_errors` (the worker and operator check the same), and
treats an unset field as its default, because the API server runs CEL on the stored object, where
policy defaults are not materialised.
"""

from __future__ import annotations

from typing import Any

G = "(self.group.nodes * self.group.gpusPerNode)"


def _opt(path: str, default: str) -> str:
    """CEL for "the field, or its default when unset"."""
    head, _, leaf = path.rpartition(".")
    return f"(has({head}.{leaf}) ? {path} : {default})"


def layout_rules() -> list[dict[str, Any]]:
    p = "self.policy"
    st, sh, ss, sd, te = (f"{p}.{k}" for k in ("static", "shift", "seesaw", "sidp", "tetris"))
    shift_tp = _opt(f"{sh}.tp", "1")
    sidp_tp = _opt(f"{sd}.tp", "1")
    pre_tp = _opt(f"{ss}.prefill.tp", "1")
    dec_pp = _opt(f"{ss}.decode.pp", "1")
    decode_gpus = f"{_opt(f'{te}.decodeInstances', '1')} * {_opt(f'{te}.decodeTp', '1')}"
    pre_inst = _opt(
        f"{te}.prefillInstances", f"({G} - {decode_gpus}) / {_opt(f'{te}.prefillTp', '1')}"
    )
    groups = "the group's GPUs (group.nodes × group.gpusPerNode)"
    rules = [
        (
            f"!has({st}) || {_opt(f'{st}.tp', '1')} * {_opt(f'{st}.pp', '1')} * "
            f"{_opt(f'{st}.sp', '1')} * {_opt(f'{st}.dp', '1')} == {G}",
            f"policy.static: tp × pp × sp × dp must equal {groups}",
            ".policy.static",
        ),
        (
            f"!has({sh}) || {_opt(f'{sh}.sp', f'{G} / {shift_tp}')} * {shift_tp} == {G}",
            f"policy.shift: sp × tp must equal {groups}",
            ".policy.shift",
        ),
        (
            f"!has({ss}) || !has({ss}.prefill) || "
            f"{pre_tp} * {_opt(f'{ss}.prefill.pp', f'{G} / {pre_tp}')} == {G}",
            f"policy.seesaw.prefill: tp × pp must equal {groups}",
            ".policy.seesaw.prefill",
        ),
        (
            f"!has({ss}) || !has({ss}.decode) || "
            f"{_opt(f'{ss}.decode.tp', f'{G} / {dec_pp}')} * {dec_pp} == {G}",
            f"policy.seesaw.decode: tp × pp must equal {groups}",
            ".policy.seesaw.decode",
        ),
        (
            f"!has({sd}) || {_opt(f'{sd}.dp', f'{G} / {sidp_tp}')} * {sidp_tp} == {G}",
            f"policy.sidp: dp × tp must equal {groups}",
            ".policy.sidp",
        ),
        (
            f"!has({te}) || ({pre_inst} >= 1 && "
            f"{pre_inst} * {_opt(f'{te}.prefillTp', '1')} + {decode_gpus} == {G})",
            "policy.tetris: prefillInstances × prefillTp + decodeInstances × decodeTp must "
            f"equal {groups}",
            ".policy.tetris",
        ),
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
        (
            f"self.engine == 'vllm' || !has({st}) || {_opt(f'{st}.dp', '1')} == 1",
            "policy.static.dp: the gearshift engine needs 1; scale out with replicas",
            ".policy.static.dp",
        ),
    ]
    return [{"rule": r, "message": m, "fieldPath": f} for r, m, f in rules]


def add_policy_rules(schema: dict[str, Any]) -> None:
    """Attach per-policy CEL rules to the generated policy schema."""
    props = schema["properties"]
    props["seesaw"]["x-kubernetes-validations"] = [
        {
            "rule": f"{_opt('self.switchToPrefillAtHostUsage', '0.0')} < "
            f"{_opt('self.switchToDecodeAtHostUsage', '1.0')}",
            "message": "switchToPrefillAtHostUsage must be below switchToDecodeAtHostUsage",
        }
    ]
    props["sidp"]["x-kubernetes-validations"] = [
        {
            "rule": f"{_opt('self.wasEnterBatchSize', '64')} > "
            f"{_opt('self.casEnterBatchSize', '32')}",
            "message": "wasEnterBatchSize must be above casEnterBatchSize (hysteresis)",
        },
        {
            "rule": "!has(self.prefetchDepth) || !has(self.wasCacheSlots) || "
            "self.prefetchDepth <= self.wasCacheSlots",
            "message": "prefetchDepth must not exceed wasCacheSlots",
        },
    ]
    props["tetris"]["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.maxSp) || !has(self.prefillInstances) || "
            "self.maxSp <= self.prefillInstances",
            "message": "maxSp must not exceed prefillInstances",
        }
    ]
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
