"""``policy: auto``'s choice (issue 16, item 4): the ``AutoPolicy`` of an InferenceDeployment
turned into ``gearshift plan``'s inputs for one worker group, simulated, and the winner returned as
a concrete ``spec.policy`` with the reason and the predicted figures.

The operator fixes the group's shape (``spec.group``: nodes × GPUs per node) and the number of
groups (``spec.replicas``); ``auto`` chooses the policy and layout inside one group. So only
candidates that occupy the whole group compete (the engine runs no data-parallel replicas inside
a static group: ``static.dp`` must be 1), and each group is simulated under its even share of the
declared traffic, as the router spreads requests over the groups. Pure: no Kubernetes, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import json_format

from gearshift.operator.sim import calibration, model_desc
from gearshift.operator.sim import hardware as hw_mod
from gearshift.operator.sim import pricing as pricing_mod
from gearshift.operator.sim.candidates import MODELLED_KINDS, PlanSettings
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.planning import (
    CandidateResult,
    PlanReport,
    plan_deployment,
    simulate_point,
)
from gearshift.operator.sim.roofline import RooflineCost
from gearshift.operator.sim.traffic import Traffic
from gearshift.v1 import policy_fields, policy_pb2

FIELD = "spec.policy.auto"
# Shift thresholds tried once Shift wins (scheduled tokens; a step above runs the SP gear).
SHIFT_THRESHOLDS = (64, 256, 1024, 4096)
DEFAULT_MAX_MODEL_LEN = 32768


class AutoError(ValueError):
    """The auto policy cannot be planned; ``field`` names the spec field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GroupShape:
    """What the operator fixes: the group's GPUs, how they sit on nodes, how many groups."""

    gpus: int
    gpus_per_node: int
    replicas: int
    max_model_len: int | None = None


@dataclass(frozen=True)
class AutoChoice:
    policy: dict[str, Any]  # the chosen spec.policy, e.g. {"shift": {"sp": 8, "tp": 1}}
    candidate: str  # gearshift plan's name for it, e.g. "shift8"
    reason: str
    predicted: dict[str, Any]  # the winner's figures at the declared rate (camelCase)
    considered: list[dict[str, Any]]  # one line per candidate that competed
    report: PlanReport
    pricing: str = ""  # what priced the steps: the GPU preset or the profile (named)
    profile: dict[str, str] | None = None  # {configMap, describe} when a profile priced them


def model_of(auto: policy_pb2.AutoPolicy) -> model_desc.ModelDesc:
    where = f"{FIELD}.model"
    if not auto.HasField("model"):
        raise AutoError(where, "required: the model's shape (its config.json's fields)")
    cfg = json_format.MessageToDict(auto.model, preserving_proto_field_name=True)
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg["_name_or_path"] = "model"
    try:
        return model_desc.from_config(cfg, where)
    except model_desc.ModelDescError as exc:
        raise AutoError(where, str(exc).removeprefix(f"{where}: ")) from None


def hardware_of(gpu: str, shape: GroupShape) -> hw_mod.Hardware:
    where = f"{FIELD}.gpu"
    name = gpu.strip().upper()
    if name not in hw_mod.PRESETS:
        known = ", ".join(sorted(hw_mod.PRESETS))
        raise AutoError(where, f"{gpu!r} is not a device the planner describes ({known})")
    hw = hw_mod.preset(f"{shape.gpus}x{name}")
    # The group's own node shape, not the preset's: the links a layout crosses depend on it.
    return replace(hw, devices_per_node=min(shape.gpus_per_node, shape.gpus))


def _lengths(msg: policy_pb2.AutoLengths) -> dict[str, Any]:
    if msg.HasField("preset") and msg.HasField("fixed"):
        raise ValueError("set one of preset and fixed")
    return {"preset": msg.preset} if msg.HasField("preset") else {"fixed": msg.fixed}


SOURCE_FIELD = f"{FIELD}.traffic.source"


def traffic_of(
    auto: policy_pb2.AutoPolicy, shape: GroupShape, observed: dict[str, Any] | None = None
) -> Traffic:
    """One group's traffic: the declared fields, or ``observed`` (traffic.source: Observed:
    the router's quantised figures, {rate, burstiness, prompt, output} for the deployment)."""
    where = f"{FIELD}.traffic"
    if not auto.HasField("traffic"):
        raise AutoError(where, "required: at least traffic.rate (requests per second)")
    t = auto.traffic
    full = policy_pb2.AutoPolicy()
    full.CopyFrom(auto)
    policy_fields.fill_constants(full)
    if observed is not None:
        return _observed_traffic(observed, full.requests, shape)
    # Each group's share: the router spreads requests evenly over spec.replicas groups.
    data: dict[str, Any] = {
        "rate": t.rate / max(shape.replicas, 1),
        "burstiness": full.traffic.burstiness,
        "requests": full.requests,
        "seed": 0,
    }
    for side in ("prompt", "output"):
        if t.HasField(side):
            try:
                data[side] = _lengths(getattr(t, side))
            except ValueError as exc:
                raise AutoError(f"{where}.{side}", str(exc)) from None
    try:
        return Traffic.from_mapping(data, where)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        if field == f"{where}.requests":  # requests sits beside traffic in the spec
            field = f"{FIELD}.requests"
        raise AutoError(field, message) from None


def _observed_traffic(observed: dict[str, Any], requests: int, shape: GroupShape) -> Traffic:
    data = {
        **observed,
        "rate": float(observed["rate"]) / max(shape.replicas, 1),
        "requests": requests,
        "seed": 0,
    }
    try:
        return Traffic.from_mapping(data, f"{SOURCE_FIELD} (observed)")
    except ValueError as exc:
        raise AutoError(
            SOURCE_FIELD, f"the router's observed traffic cannot be planned: {exc}"
        ) from None


def _wrap(auto: policy_pb2.AutoPolicy) -> policy_pb2.Policy:
    p = policy_pb2.Policy()
    p.auto.CopyFrom(auto)
    return p


def kinds_of(auto: policy_pb2.AutoPolicy) -> set[str]:
    where = f"{FIELD}.policies"
    kinds = set(auto.policies) or set(MODELLED_KINDS)
    unknown = sorted(kinds - set(policy_fields.POLICY_KINDS) | (kinds & {"auto"}))
    if unknown:
        real = [k for k in policy_fields.POLICY_KINDS if k != "auto"]
        raise AutoError(where, f"{unknown} are not policy kinds ({', '.join(real)})")
    return kinds


def goodput_of(auto: policy_pb2.AutoPolicy) -> Goodput | None:
    if not auto.HasField("goodput"):
        return None
    try:
        return Goodput.parse(auto.goodput)
    except ValueError as exc:
        raise AutoError(f"{FIELD}.goodput", str(exc).removeprefix("goodput: ")) from None


def check_inputs(auto: policy_pb2.AutoPolicy, gpu: str, shape: GroupShape) -> None:
    """What ``choose`` would refuse before it simulates (the model's shape, the GPU, the declared
    traffic, the policies, the goodput), AutoError naming the field; cheap: nothing is planned.
    The operator asks it before it starts a profiling Job that takes a GPU node for minutes."""
    model_of(auto)
    hardware_of(gpu, shape)
    traffic_of(auto, shape)
    kinds_of(auto)
    goodput_of(auto)


def _camel(point: dict[str, Any] | None) -> dict[str, Any]:
    if not point:
        return {}
    keys = {
        "rate": "rate",
        "ttft_p50_s": "ttftP50Seconds",
        "ttft_p99_s": "ttftP99Seconds",
        "tpot_p50_s": "tpotP50Seconds",
        "tpot_p99_s": "tpotP99Seconds",
        "output_tokens_per_s": "outputTokensPerSecond",
    }
    out: dict[str, Any] = {
        new: round(float(point[old]), 6) for old, new in keys.items() if old in point
    }
    if "met" in point:  # with an SLO: whether the declared rate meets it (auto_apply.gain)
        out["meetsSlo"] = bool(point["met"])
    return out


PROFILE_FIELD = f"{FIELD}.profile"
PROFILE_KEY = "profile.json"  # the ConfigMap's key holding the profile


# AutoModel's fields in the CRD's names, by calibration.SHAPE_KEYS' (config.json's) names.
_CRD_NAMES = {
    "num_hidden_layers": "numHiddenLayers",
    "hidden_size": "hiddenSize",
    "num_attention_heads": "numAttentionHeads",
    "num_key_value_heads": "numKeyValueHeads",
    "intermediate_size": "intermediateSize",
    "vocab_size": "vocabSize",
    "head_dim": "headDim",
}


def profile_of(
    auto: policy_pb2.AutoPolicy, gpu: str, text: str, dtype: str = "auto"
) -> calibration.CalibrationProfile:
    """The profile in ConfigMap ``auto.profile`` (its ``profile.json`` text), checked to be
    measured on ``gpu``, of the model ``auto.model`` describes, in the dtype the deployment runs
    it in (``dtype``: spec.model.dtype; ``auto``: the model's torchDtype); AutoError naming
    spec.policy.auto.profile if not."""
    where = f"ConfigMap {auto.profile} key {PROFILE_KEY}"
    try:
        profile = calibration.parse(text, where)
    except calibration.ProfileError as exc:
        raise AutoError(PROFILE_FIELD, str(exc)) from None
    preset = hw_mod.preset_of_product(profile.device) if profile.device_kind == "cuda" else None
    if preset != gpu.strip().upper():
        raise AutoError(
            PROFILE_FIELD,
            f"{where} was measured on {profile.device} ({profile.device_kind}), not on the "
            f"group's GPU {gpu}: profile the group's GPU type (gearshift profile --layouts)",
        )
    model = model_of(auto)
    runs = model.dtype if dtype == "auto" else dtype

    def name(key: str) -> str:
        if key != "dtype":
            return f"{FIELD}.model.{_CRD_NAMES[key]}"
        if dtype != "auto":
            return "spec.model.dtype"
        set_ = auto.model.HasField("torch_dtype")
        return f"{FIELD}.model.torchDtype{'' if set_ else ' (default bfloat16)'}"

    try:
        calibration.check_model(profile, model, where, "this deployment's", name, runs)
    except calibration.ProfileError as exc:
        raise AutoError(PROFILE_FIELD, str(exc)) from None
    return profile


def choose(
    auto: policy_pb2.AutoPolicy,
    gpu: str,
    shape: GroupShape,
    profile_text: str | None = None,
    observed: dict[str, Any] | None = None,
    dtype: str = "auto",
) -> AutoChoice:
    """Plan one group of ``shape`` on ``gpu`` devices, priced from the scaled preset or, with
    ``auto.profile``, from ``profile_text`` (its ConfigMap's; ``dtype``: spec.model.dtype, which
    it must have measured, ``profile_of``), under the declared traffic or ``observed`` figures
    (traffic_of); AutoError names the field."""
    model = model_of(auto)
    hw = hardware_of(gpu, shape)
    profile: calibration.CalibrationProfile | None = None
    about: dict[str, str] | None = None
    if auto.HasField("profile"):
        if profile_text is None:
            raise AutoError(PROFILE_FIELD, f"ConfigMap {auto.profile} was not read")
        profile = profile_of(auto, gpu, profile_text, dtype)
        about = {"configMap": auto.profile, "describe": profile.describe()}
    # gearshift plan's rule (pricing.choose), on the group's own hardware shape: the profile,
    # else the preset scaled by the efficiencies fitted to the recorded GPU measurement.
    priced = pricing_mod.choose(hw, profile, gpu)
    pricing = priced.describe
    if profile is not None:
        pricing = f"the profile in ConfigMap {auto.profile}: {profile.describe()}"
    traffic = traffic_of(auto, shape, observed)
    kinds = kinds_of(auto)
    goodput = goodput_of(auto)
    settings = PlanSettings(max_model_len=shape.max_model_len or DEFAULT_MAX_MODEL_LEN)
    try:
        report = plan_deployment(
            model,
            priced.hardware,
            traffic,
            goodput,
            settings=settings,
            kinds=kinds,
            only=lambda c: c.gpus_per_group == shape.gpus,
            pricing=priced,
        )
    except ValueError as exc:  # no candidate fits the group, or none the profile covers
        raise AutoError(
            PROFILE_FIELD if profile else FIELD, str(exc).removeprefix("--profile: ")
        ) from None
    best = report.recommended
    if best is None:
        raise AutoError(FIELD, f"no layout could be simulated: {report.reason}")
    policy, reason = best.candidate.policy, report.reason
    at = best.at_rate
    if priced.excluded:
        reason += f"; not in the profile, so not candidates: {', '.join(priced.excluded)}"
    if priced.grid_note():
        reason += f"; {priced.grid_note()}"
    if best.candidate.kind == "shift" and profile is not None:
        # The measured step cost is the engine's at its default threshold; tuning would price
        # the other thresholds from the roofline, a second pricing the profile replaces.
        reason += "; threshold: the engine's default (the one the profile measured)"
    elif best.candidate.kind == "shift":
        threshold, at = _tune_threshold(best, traffic, goodput)
        policy = {"shift": {**policy["shift"], "threshold": threshold}}
        reason += f"; threshold {threshold}: best of {', '.join(map(str, SHIFT_THRESHOLDS))}"
    predicted = _camel(at)
    predicted["maxRateMeetingSlo"] = best.max_rate
    predicted["kvTokens"] = best.candidate.kv_tokens
    considered = []
    for r in report.results:
        line: dict[str, Any] = {"name": r.candidate.name}
        if r.error:
            line["error"] = r.error
        else:
            line.update(_camel(r.at_rate))
            line["maxRateMeetingSlo"] = r.max_rate
        considered.append(line)
    return AutoChoice(
        policy=policy,
        candidate=best.candidate.name,
        reason=reason,
        predicted=predicted,
        considered=considered,
        report=report,
        pricing=pricing,
        profile=about,
    )


def _tune_threshold(
    best: CandidateResult, traffic: Traffic, goodput: Goodput | None
) -> tuple[int, dict[str, Any]]:
    """Shift's threshold (a live field) for the winner: the SLO met first, then the lowest p99
    TTFT, then p99 TPOT, then the smallest threshold, at the declared rate (Shift §3.3, Alg. 3:
    the plan compares the simulated switch points instead of the cheaper gear per step)."""
    c = best.candidate
    scored = []
    for t in SHIFT_THRESHOLDS:
        cost = RooflineCost(c.cost.model, c.cost.hw, c.cost.layout, shift_threshold=t)
        point = simulate_point(replace(c, cost=cost), traffic, traffic.rate, goodput)
        key = (not point.get("met", True), point["ttft_p99_s"], point["tpot_p99_s"], t)
        scored.append((key, t, point))
    _, threshold, point = min(scored, key=lambda x: x[0])
    return threshold, point
