"""Reads the policy schema's field options: live fields, defaults, layout checks.

The options are declared in options.proto and set in policy.proto. The operator, the router and
the worker all decide "live or restart", "which default" and "does the layout fit the group" here,
so the three never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gearshift.v1 import options_pb2, policy_pb2

POLICY_KINDS: tuple[str, ...] = tuple(
    f.name for f in policy_pb2.Policy.DESCRIPTOR.oneofs_by_name["kind"].fields
)


def is_live(field: FieldDescriptor) -> bool:
    """Whether a change of this field may be applied without restarting the group."""
    return bool(field.GetOptions().Extensions[options_pb2.live])


def default_text(field: FieldDescriptor) -> str:
    """The constant default of a field as proto text, or "" when none (derived or zero)."""
    return str(field.GetOptions().Extensions[options_pb2.default_value])


def bounds(field: FieldDescriptor) -> tuple[float | None, float | None]:
    """The (minimum, maximum) options of a field; None where not set."""
    opts = field.GetOptions()
    lo = opts.Extensions[options_pb2.minimum] if opts.HasExtension(options_pb2.minimum) else None
    hi = opts.Extensions[options_pb2.maximum] if opts.HasExtension(options_pb2.maximum) else None
    return lo, hi


def kind_of(policy: policy_pb2.Policy) -> str:
    """The name of the set policy ("static", "shift", ...), or "" when none is set."""
    return policy.WhichOneof("kind") or ""


def _is_set(msg: Message, field: FieldDescriptor) -> bool:
    if field.is_repeated:
        return len(getattr(msg, field.name)) > 0
    if field.has_presence:
        return msg.HasField(field.name)
    return bool(getattr(msg, field.name))


def walk_fields(descriptor: Descriptor, prefix: str = "") -> Iterator[tuple[str, FieldDescriptor]]:
    """Every field of a message, depth first, as ("shift.threshold", descriptor) pairs.

    Repeated message fields are leaves: they are compared and applied as a whole.
    """
    for field in descriptor.fields:
        path = f"{prefix}{field.name}"
        is_msg = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_msg and not field.is_repeated:
            yield from walk_fields(field.message_type, f"{path}.")
        else:
            yield path, field


def _get(msg: Message, path: str) -> tuple[Message, FieldDescriptor] | None:
    *parents, leaf = path.split(".")
    for name in parents:
        if not msg.HasField(name):
            return None
        msg = getattr(msg, name)
    return msg, msg.DESCRIPTOR.fields_by_name[leaf]


def changed_fields(old: policy_pb2.Policy, new: policy_pb2.Policy) -> list[str]:
    """Paths of the fields whose effective value differs, e.g. ["shift.threshold"].

    A different policy kind is reported as ["kind"]. Compare policies with defaults filled in
    (`with_defaults`) so that "unset" and "set to the default" are the same.
    """
    if kind_of(old) != kind_of(new):
        return ["kind"]
    kind = kind_of(new)
    if not kind:
        return []
    changed = []
    for path, _ in walk_fields(policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind].message_type):
        a, b = _get(getattr(old, kind), path), _get(getattr(new, kind), path)
        va = _value(a)
        vb = _value(b)
        if va != vb:
            changed.append(f"{kind}.{path}")
    return changed


def _value(found: tuple[Message, FieldDescriptor] | None) -> object:
    if found is None:
        return None
    msg, field = found
    if not _is_set(msg, field):
        return None
    value = getattr(msg, field.name)
    if field.is_repeated:
        return (
            [v.SerializeToString(deterministic=True) for v in value]
            if field.message_type
            else list(value)
        )
    return value


def non_live_changes(old: policy_pb2.Policy, new: policy_pb2.Policy) -> list[str]:
    """The changed paths that need a restart (kind changes included)."""
    out = []
    for path in changed_fields(old, new):
        if path == "kind":
            out.append(path)
            continue
        kind, rest = path.split(".", 1)
        msg_desc = policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind].message_type
        found = _get_descriptor(msg_desc, rest)
        if found is None or not is_live(found):
            out.append(path)
    return out


def _get_descriptor(desc: Descriptor, path: str) -> FieldDescriptor | None:
    *parents, leaf = path.split(".")
    for name in parents:
        desc = desc.fields_by_name[name].message_type
    return desc.fields_by_name.get(leaf)


def live_only(policy: policy_pb2.Policy) -> policy_pb2.Policy:
    """A copy holding only the live fields that are set (the payload of an ApplyPolicy call)."""
    out = policy_pb2.Policy()
    kind = kind_of(policy)
    if not kind:
        return out
    src, dst = getattr(policy, kind), getattr(out, kind)
    dst.SetInParent()
    for path, field in walk_fields(src.DESCRIPTOR):
        found = _get(src, path)
        if found is None or not is_live(field) or not _is_set(*found):
            continue
        *parents, leaf = path.split(".")
        target = dst
        for name in parents:
            target = getattr(target, name)
        value = getattr(found[0], leaf)
        if field.is_repeated:
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return out


def with_defaults(policy: policy_pb2.Policy, group_gpus: int | None = None) -> policy_pb2.Policy:
    """A copy with every unset field given its default.

    Constant defaults come from the `default_value` option; derived ones (e.g. shift.sp = G / tp)
    need `group_gpus` and are left unset without it.
    """
    out = policy_pb2.Policy()
    out.CopyFrom(policy)
    kind = kind_of(out)
    if not kind:
        return out
    msg = getattr(out, kind)
    _fill_constants(msg)
    if group_gpus is not None:
        _fill_derived(kind, msg, group_gpus)
    return out


def _fill_constants(msg: Message) -> None:
    for field in msg.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if not field.is_repeated:
                _fill_constants(getattr(msg, field.name))
            continue
        text = default_text(field)
        if text and not _is_set(msg, field):
            text_format.Merge(f"{field.name}: {text}", msg)


def _fill_derived(kind: str, msg: Message, g: int) -> None:
    def setdefault(target: Message, name: str, value: int) -> None:
        if not target.HasField(name):
            setattr(target, name, max(value, 0))

    if kind == "shift":
        setdefault(msg, "sp", g // max(msg.tp, 1))
    elif kind == "seesaw":
        setdefault(msg.prefill, "tp", 1)
        setdefault(msg.prefill, "pp", g // msg.prefill.tp)
        setdefault(msg.decode, "pp", 1)
        setdefault(msg.decode, "tp", g // msg.decode.pp)
    elif kind == "sidp":
        setdefault(msg, "dp", g // max(msg.tp, 1))
        setdefault(msg, "was_cache_slots", max(msg.dp - 1, 1))
        setdefault(msg, "prefetch_depth", msg.was_cache_slots)
    elif kind == "tetris":
        left = g - msg.decode_instances * msg.decode_tp
        setdefault(msg, "prefill_instances", left // max(msg.prefill_tp, 1))
        setdefault(msg, "max_sp", msg.prefill_instances)
        setdefault(msg, "transfer_backends", msg.prefill_instances)


def layout_gpus(policy: policy_pb2.Policy) -> int:
    """GPUs (ranks) the layout of a defaults-filled policy occupies."""
    kind = kind_of(policy)
    msg = getattr(policy, kind) if kind else None
    if kind == "static":
        return msg.tp * msg.pp * msg.sp * msg.dp
    if kind == "shift":
        return msg.sp * msg.tp
    if kind == "seesaw":
        return msg.prefill.tp * msg.prefill.pp
    if kind == "sidp":
        return msg.dp * msg.tp
    if kind == "tetris":
        return msg.prefill_instances * msg.prefill_tp + msg.decode_instances * msg.decode_tp
    return 0


def layout_errors(policy: policy_pb2.Policy, group_gpus: int) -> list[str]:
    """Why a policy's layout does not fit a group of `group_gpus` ranks; empty when it does.

    Mirrors the CRD's CEL rules, so a policy that reaches a worker by another path (the Admin API,
    `gearshift serve`) is checked the same way.
    """
    kind = kind_of(policy)
    if not kind:
        return ["policy: exactly one of " + ", ".join(POLICY_KINDS) + " must be set"]
    if kind == "auto":
        return []  # planned into a concrete policy first, which is checked in turn
    full = with_defaults(policy, group_gpus)
    msg = getattr(full, kind)
    errors = []
    if layout_gpus(full) != group_gpus:
        errors.append(
            f"policy.{kind}: layout uses {layout_gpus(full)} GPUs, group has {group_gpus}"
        )
    if kind == "seesaw" and msg.decode.tp * msg.decode.pp != group_gpus:
        errors.append(f"policy.seesaw.decode: tp × pp must equal the group's {group_gpus} GPUs")
    if (
        kind == "seesaw"
        and msg.switch_to_prefill_at_host_usage >= msg.switch_to_decode_at_host_usage
    ):
        errors.append(
            "policy.seesaw: switchToPrefillAtHostUsage must be below switchToDecodeAtHostUsage"
        )
    if kind == "sidp" and msg.was_enter_batch_size <= msg.cas_enter_batch_size:
        errors.append("policy.sidp: wasEnterBatchSize must be above casEnterBatchSize")
    if kind == "sidp" and msg.prefetch_depth > msg.was_cache_slots:
        errors.append("policy.sidp: prefetchDepth must not exceed wasCacheSlots")
    if kind == "tetris" and msg.prefill_instances < 1:
        errors.append(
            f"policy.tetris: no prefill instance fits: the group's {group_gpus} GPUs minus "
            f"decodeInstances × decodeTp = {msg.decode_instances * msg.decode_tp} leave none"
        )
    if kind == "tetris" and msg.max_sp > msg.prefill_instances:
        errors.append("policy.tetris: maxSp must not exceed prefillInstances")
    return errors
