"""Repeated live fields (a Tetris policy's ``latencyModels`` and ``improvementRateTable``) as
live values: the field's elements in order, a message element as its fields by proto name. An
update replaces every element, checked against the proto's bounds, or changes nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gearshift.v1 import policy_fields
from gearshift.worker.engine.contract import LiveItem
from gearshift.worker.errors import InvalidRequestError


def items_of(field: FieldDescriptor, values: Iterable[Any]) -> tuple[LiveItem, ...]:
    """A repeated field's elements as live items."""
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return tuple(values)
    return tuple(
        json_format.MessageToDict(
            v, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        for v in values
    )


def set_items(msg: Message, field: FieldDescriptor, items: Any, path: str) -> None:
    """Replace ``msg``'s repeated ``field`` by ``items``; refuses (naming ``path[i].field``) an
    element of the wrong type or outside the proto's bounds."""
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(path, f"{path} must be a list, got {items!r}")
    target = getattr(msg, field.name)
    fresh = type(msg)()
    staged = getattr(fresh, field.name)
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            try:
                staged.append(item)
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(where, f"{where}: {exc}") from None
            continue
        if not isinstance(item, dict):
            raise InvalidRequestError(where, f"{where} must be a mapping, got {item!r}")
        element = staged.add()
        try:
            json_format.ParseDict(item, element)
        except json_format.ParseError as exc:
            raise InvalidRequestError(where, f"{where}: {exc}") from None
        for sub in field.message_type.fields:
            value = getattr(element, sub.name)
            lo, hi = policy_fields.bounds(sub)
            if isinstance(value, (int, float)) and (
                (lo is not None and value < lo) or (hi is not None and value > hi)
            ):
                raise InvalidRequestError(
                    f"{where}.{sub.name}",
                    f"{where}.{sub.name} must be in [{lo}, {hi}], got {value}",
                )
    del target[:]
    target.extend(staged)
