"""Reads the policy schema: which kind is set, its message, and its fields' options (live
fields, constant defaults, bounds).

The options are declared in options.proto and set in policy.proto (or a policy package's own
.proto). The operator, the router and the worker all decide "live or restart" and "which
constant default" here, so the three never disagree. What depends on the kind (derived
defaults, layout checks) is the kind's spec: worker/policies/checks.py.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf import descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gearshift.v1 import options_pb2, policy_pb2

# A policy kind defined by a package outside gearshift.v1 travels packed in this oneof member;
# its type URL names the kind and the message ("gearshift.dev/policy/<kind>/<message name>").
PLUGIN_FIELD = "plugin"
PLUGIN_URL_PREFIX = "gearshift.dev/policy/"

# gearshift.v1's own kinds, in the oneof's order (a package's kinds: worker/policies/kinds.py).
POLICY_KINDS: tuple[str, ...] = tuple(
    f.name
    for f in policy_pb2.Policy.DESCRIPTOR.oneofs_by_name["kind"].fields
    if f.name != PLUGIN_FIELD
)


class UnknownPolicyKind(ValueError):
    """A packed policy whose message this process has not loaded (its package is missing)."""


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
    """The name of the set policy ("static", "shift", a package's kind), or "" when none."""
    which = policy.WhichOneof("kind") or ""
    if which != PLUGIN_FIELD:
        return which
    kind, _, _ = policy.plugin.type_url.removeprefix(PLUGIN_URL_PREFIX).partition("/")
    return kind


def message_of(policy: policy_pb2.Policy) -> Message:
    """The set policy's own message. A built-in kind's is the policy's sub-message itself; a
    package's is an unpacked copy (change a copy, then build the policy with ``policy_of``)."""
    which = policy.WhichOneof("kind")
    if which is None:
        raise UnknownPolicyKind("no policy kind is set")
    if which != PLUGIN_FIELD:
        return getattr(policy, which)  # type: ignore[no-any-return]
    name = policy.plugin.type_url.rpartition("/")[2]
    try:
        cls = message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(name))
    except KeyError as exc:
        raise UnknownPolicyKind(
            f"policy kind {kind_of(policy)!r} ({name}) is not installed in this process: install "
            "its package or name it in GEARSHIFT_POLICY_PACKAGES (docs/parallelism.md)"
        ) from exc
    msg = cls()
    policy.plugin.Unpack(msg)
    return msg


def policy_of(kind: str, message: Message) -> policy_pb2.Policy:
    """A Policy holding ``message`` as ``kind``: in its oneof member, or packed for a package's."""
    out = policy_pb2.Policy()
    if kind in POLICY_KINDS:
        getattr(out, kind).CopyFrom(message)
    else:
        out.plugin.Pack(message, PLUGIN_URL_PREFIX + kind, deterministic=True)
    return out


def copy_of(policy: policy_pb2.Policy) -> Message:
    """A copy of the set policy's message, safe to change."""
    src = message_of(policy)
    out = type(src)()
    out.CopyFrom(src)
    return out


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
    (``with_defaults``) so that "unset" and "set to the default" are the same.
    """
    if kind_of(old) != kind_of(new):
        return ["kind"]
    kind = kind_of(new)
    if not kind:
        return []
    a_msg, b_msg = message_of(old), message_of(new)
    changed = []
    for path, _ in walk_fields(b_msg.DESCRIPTOR):
        if _value(_get(a_msg, path)) != _value(_get(b_msg, path)):
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
        _, rest = path.split(".", 1)
        found = _get_descriptor(message_of(new).DESCRIPTOR, rest)
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
    kind = kind_of(policy)
    if not kind:
        return policy_pb2.Policy()
    src = message_of(policy)
    dst = type(src)()
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
    return policy_of(kind, dst)


def without_live(policy: policy_pb2.Policy) -> policy_pb2.Policy:
    """A copy with every live field cleared: what a group must be restarted to change."""
    kind = kind_of(policy)
    if not kind:
        return policy_pb2.Policy()
    msg = copy_of(policy)
    for path, field in walk_fields(msg.DESCRIPTOR):
        if is_live(field):
            *parents, leaf = path.split(".")
            target = msg
            for name in parents:
                target = getattr(target, name)
            target.ClearField(leaf)
    return policy_of(kind, msg)


def fill_constants(msg: Message) -> None:
    """Give every unset field of ``msg`` (and its sub-messages) its ``default_value`` option."""
    for field in msg.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if not field.is_repeated:
                fill_constants(getattr(msg, field.name))
            continue
        text = default_text(field)
        if text and not _is_set(msg, field):
            text_format.Merge(f"{field.name}: {text}", msg)


def bound_errors(msg: Message, prefix: str) -> list[str]:
    """Set fields outside their (minimum, maximum) options, named ``prefix.path``."""
    errors = []
    for path, field in walk_fields(msg.DESCRIPTOR):
        found = _get(msg, path)
        if found is None or field.is_repeated or not _is_set(*found):
            continue
        if field.type in (FieldDescriptor.TYPE_ENUM, FieldDescriptor.TYPE_BOOL):
            continue
        lo, hi = bounds(field)
        value = getattr(found[0], field.name)
        if lo is not None and value < lo:
            errors.append(f"{prefix}.{path}: must be at least {lo:g}, got {value:g}")
        elif hi is not None and value > hi:
            errors.append(f"{prefix}.{path}: must be at most {hi:g}, got {value:g}")
    return errors
