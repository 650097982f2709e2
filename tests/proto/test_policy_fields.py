"""The policy schema's options: which fields are live, defaults, change detection, layout checks."""

from __future__ import annotations

from google.protobuf import json_format

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.policies import checks


def _policy(d: dict) -> policy_pb2.Policy:
    return json_format.ParseDict(d, policy_pb2.Policy())


def _live_paths(kind: str) -> set[str]:
    desc = policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind].message_type
    return {p for p, f in policy_fields.walk_fields(desc) if policy_fields.is_live(f)}


def test_thresholds_hysteresis_mode_and_improvement_rate_are_live_and_layouts_are_not() -> None:
    assert _live_paths("static") == set()
    assert _live_paths("shift") == {"threshold"}
    assert {"switch_to_decode_at_host_usage", "switch_to_prefill_at_host_usage"} <= _live_paths(
        "seesaw"
    )
    sidp = _live_paths("sidp")
    assert {"mode", "cas_enter_batch_size", "was_enter_batch_size", "min_dwell_steps"} <= sidp
    assert {"improvement_rate", "improvement_rate_table"} <= _live_paths("tetris")
    layout = {
        "shift": {"sp", "tp"},
        "seesaw": {"prefill.tp", "prefill.pp", "decode.tp", "decode.pp"},
        "sidp": {"dp", "tp", "was_cache_slots"},
        "tetris": {"prefill_instances", "prefill_tp", "decode_instances", "decode_tp"},
    }
    for kind, fields in layout.items():
        assert not fields & _live_paths(kind), kind


def test_every_policy_field_with_a_nonzero_default_tracks_presence() -> None:
    for kind in policy_fields.POLICY_KINDS:
        desc = policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind].message_type
        for path, field in policy_fields.walk_fields(desc):
            if policy_fields.default_text(field) and field.enum_type is None:
                assert field.has_presence, f"{kind}.{path} needs `optional`"


def test_with_defaults_fills_constant_and_derived_defaults() -> None:
    full = checks.with_defaults(_policy({"shift": {}}), group_gpus=8)
    assert (full.shift.sp, full.shift.tp, full.shift.threshold) == (8, 1, 256)
    sidp = checks.with_defaults(_policy({"sidp": {"tp": 2}}), group_gpus=8).sidp
    assert (sidp.dp, sidp.was_cache_slots, sidp.mode) == (4, 3, policy_pb2.SidpPolicy.AUTO)
    tetris = checks.with_defaults(_policy({"tetris": {"decodeTp": 4}}), 8).tetris
    assert (tetris.prefill_instances, tetris.max_sp, tetris.chunk_granularity) == (4, 4, 1024)
    # No default: unset, the router profiles the improvement rate itself (tetris_rate_profile).
    assert not tetris.HasField("improvement_rate")


def test_a_threshold_change_is_live_and_an_sp_change_is_not() -> None:
    old = checks.with_defaults(_policy({"shift": {"sp": 4, "tp": 2}}), 8)
    new = checks.with_defaults(_policy({"shift": {"sp": 4, "tp": 2, "threshold": 512}}), 8)
    assert policy_fields.changed_fields(old, new) == ["shift.threshold"]
    assert policy_fields.non_live_changes(old, new) == []
    relayout = checks.with_defaults(_policy({"shift": {"sp": 2, "tp": 4}}), 8)
    assert policy_fields.non_live_changes(old, relayout) == ["shift.sp", "shift.tp"]
    assert policy_fields.non_live_changes(old, _policy({"static": {}})) == ["kind"]


def test_live_only_keeps_set_live_fields() -> None:
    p = _policy({"sidp": {"dp": 4, "mode": "CAS", "casEnterBatchSize": 16}})
    live = policy_fields.live_only(p)
    assert json_format.MessageToDict(live) == {"sidp": {"mode": "CAS", "casEnterBatchSize": 16}}


def test_layout_errors_name_the_policy_and_the_mismatch() -> None:
    assert checks.layout_errors(_policy({"shift": {"sp": 4, "tp": 2}}), 8) == []
    errors = checks.layout_errors(_policy({"shift": {"sp": 3, "tp": 2}}), 8)
    assert errors and "policy.shift" in errors[0]
    assert checks.layout_errors(_policy({"seesaw": {"prefill": {"pp": 4}}}), 4) == []
    assert checks.layout_errors(policy_pb2.Policy(), 4)[0].startswith("policy: exactly one")
