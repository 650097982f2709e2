"""Hypothesis strategies for any protobuf message, built from its descriptor.

Each field draws a value of its declared type, bounded to what the wire can carry: integers over
their whole range (and the edges), floats with nan and infinities, text (no lone surrogates:
protobuf refuses to hold them), bytes, enums with their numbers and unknown ones (proto3 enums
are open), repeated fields and maps of a few entries, nested messages down to `max_depth`, and
at most one member of each oneof. Fields are left unset as often as they are set.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_INTS: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integer(low: int, high: int) -> st.SearchStrategy[int]:
    # Small values are where the meaning is; the edges are where overflows are.
    edges = st.sampled_from(sorted({low, high, 0, 1, -1 if low < 0 else 2, low + 1, high - 1}))
    return st.one_of(st.integers(-3 if low < 0 else 0, 64), edges, st.integers(low, high))


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size)


def scalar(field: FieldDescriptor, max_size: int = 24) -> st.SearchStrategy[Any]:
    """A value of a non-message field's type."""
    t = field.type
    if t in _INTS:
        return _integer(*_INTS[t])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == FieldDescriptor.TYPE_STRING:
        return _text(max_size)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=max_size)
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"{field.full_name}: no strategy for type {t}")


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _real_oneofs(descriptor: Descriptor) -> list[Any]:
    """Oneofs the schema declares; proto3 `optional` makes a one-field "_name" oneof of its own,
    which is a plain field with presence here."""
    return [
        o
        for o in descriptor.oneofs
        if not (len(o.fields) == 1 and o.name == f"_{o.fields[0].name}")
    ]


def _is_map(field: FieldDescriptor) -> bool:
    mt = field.message_type
    return mt is not None and mt.GetOptions().map_entry


def _field_value(field: FieldDescriptor, depth: int, max_items: int) -> st.SearchStrategy[Any]:
    if _is_map(field):
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        values = (
            message(value.message_type, depth - 1, max_items)
            if value.message_type is not None
            else scalar(value)
        )
        return st.dictionaries(scalar(key), values, max_size=max_items)
    one = (
        message(field.message_type, depth - 1, max_items)
        if field.message_type is not None
        else scalar(field)
    )
    return st.lists(one, max_size=max_items) if _is_repeated(field) else one


def message(
    descriptor: Descriptor, max_depth: int = 4, max_items: int = 4
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type; nested messages stop (stay unset) below `max_depth`."""
    cls = GetMessageClass(descriptor)
    if max_depth <= 0:
        return st.just(cls())
    oneofs = _real_oneofs(descriptor)
    oneof_members = {f.name for o in oneofs for f in o.fields}
    plain = {
        f.name: st.none() | _field_value(f, max_depth, max_items)
        for f in descriptor.fields
        if f.name not in oneof_members
    }
    choices = [
        st.none()
        | st.sampled_from(list(o.fields)).flatmap(
            lambda f: st.tuples(st.just(f.name), _field_value(f, max_depth, max_items))
        )
        for o in oneofs
    ]

    def build(values: dict[str, Any], picked: list[tuple[str, Any] | None]) -> Message:
        msg = cls()
        for name, value in [*values.items(), *(p for p in picked if p is not None)]:
            if value is not None:
                _set(msg, descriptor.fields_by_name[name], value)
        return msg

    return st.builds(build, st.fixed_dictionaries(plain), st.tuples(*choices).map(list))


def _set(msg: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(msg, field.name)
    if _is_map(field):
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif _is_repeated(field):
        if field.message_type is not None:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)
