"""OpenAPI v3 schema of `spec.policy`, generated from the proto Policy message.

The proto is the one policy schema (DESIGN.md). Field names are the proto JSON names, types and
bounds come from the descriptor and the options in options.proto, descriptions from the .proto
comments (read through protoc's source info, so generating the CRD needs grpcio-tools; the
running operator does not).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.policies import kinds, policy_json

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"

_INT_TYPES = {
    FieldDescriptor.TYPE_INT32: ("int32", False),
    FieldDescriptor.TYPE_UINT32: ("int64", True),  # uint32 exceeds int32's range
    FieldDescriptor.TYPE_INT64: ("int64", False),
    FieldDescriptor.TYPE_UINT64: ("int64", True),
    FieldDescriptor.TYPE_SINT32: ("int32", False),
    FieldDescriptor.TYPE_SINT64: ("int64", False),
}

_32_BITS = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_SINT32}


def proto_comments(proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """Leading comments of every message and field, keyed by full name (gearshift.v1.X.y):
    gearshift.v1's, and those of the policy packages that name their .proto (ProtoSource)."""
    files = sorted(
        str(p.relative_to(proto_root)) for p in (proto_root / "gearshift/v1").glob("*.proto")
    )
    comments = _comments_of([proto_root], files)
    for spec in kinds.specs():
        if spec.proto_source is not None:
            src = spec.proto_source
            comments.update(_comments_of([src.root, proto_root], [src.file]))
    return comments


def _comments_of(roots: list[Path], files: list[str]) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                *(f"-I{root}" for root in roots),
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *files,
            ],
            check=True,
            timeout=120,
        )
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    comments: dict[str, str] = {}
    for f in fds.file:
        by_path = {tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location}
        _collect(f.message_type, f.package, (4,), by_path, comments)
    return comments


def _collect(
    msgs: Any,
    prefix: str,
    path: tuple[int, ...],
    by_path: dict[tuple[int, ...], str],
    out: dict[str, str],
) -> None:
    # Source-info paths: 4 = message_type, 3 = nested_type, 2 = field (descriptor.proto numbers).
    for i, m in enumerate(msgs):
        name = f"{prefix}.{m.name}"
        out[name] = by_path.get((*path, i), "")
        for j, fld in enumerate(m.field):
            out[f"{name}.{fld.name}"] = by_path.get((*path, i, 2, j), "")
        _collect(m.nested_type, name, (*path, i, 3), by_path, out)


def _clean(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()).strip()


def _field_schema(field: FieldDescriptor, comments: dict[str, str]) -> dict[str, Any]:
    schema: dict[str, Any]
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        schema = message_schema(field.message_type, comments)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        values = [v.name for v in field.enum_type.values if v.number != 0]
        schema = {"type": "string", "enum": values}
    elif field.type in _INT_TYPES:
        fmt, unsigned = _INT_TYPES[field.type]
        schema = {"type": "integer", "format": fmt}
        if unsigned:
            schema["minimum"] = 0
        # The proto type's own range: past it the operator's parse refuses what the API server
        # would have stored (a uint32 is carried as an int64).
        bits = 32 if field.type in _32_BITS else 64
        if unsigned and bits == 32:
            schema["maximum"] = 2**32 - 1
        elif not unsigned and bits == 32:
            schema["minimum"], schema["maximum"] = -(2**31), 2**31 - 1
    elif field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        schema = {"type": "number"}
    elif field.type == FieldDescriptor.TYPE_BOOL:
        schema = {"type": "boolean"}
    else:
        schema = {"type": "string"}
    lo, hi = policy_fields.bounds(field)
    if lo is not None:
        schema["minimum"] = int(lo) if schema["type"] == "integer" else lo
    if hi is not None:
        schema["maximum"] = int(hi) if schema["type"] == "integer" else hi
    description = _clean(comments.get(field.full_name, ""))
    if policy_fields.is_live(field):
        description += " Live: changes apply without restarting pods."
    if field.is_repeated:
        schema = {"type": "array", "x-kubernetes-list-type": "atomic", "items": schema}
    if description.strip():
        schema["description"] = description.strip()
    return schema


def message_schema(desc: Descriptor, comments: dict[str, str]) -> dict[str, Any]:
    """A proto message as a structural OpenAPI object (properties keyed by JSON name)."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {f.json_name: _field_schema(f, comments) for f in desc.fields},
    }
    description = _clean(comments.get(desc.full_name, ""))
    if description:
        schema["description"] = description
    return schema


def policy_schema(comments: dict[str, str] | None = None) -> dict[str, Any]:
    """spec.policy: an object holding exactly one policy, ``{"<kind>": {...}}``, for every kind
    (gearshift.v1's and the policy packages')."""
    comments = proto_comments() if comments is None else comments
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {kind: _kind_schema(kind, comments) for kind in kinds.kinds()},
    }
    description = _clean(comments.get(policy_pb2.Policy.DESCRIPTOR.full_name, ""))
    if description:
        schema["description"] = description
    names = kinds.kinds()
    count = " + ".join(f"(has(self.{k}) ? 1 : 0)" for k in names)
    schema["x-kubernetes-validations"] = [
        {"rule": f"{count} == 1", "message": f"set exactly one of {', '.join(names)}"}
    ]
    return schema


def _kind_schema(kind: str, comments: dict[str, str]) -> dict[str, Any]:
    cls = policy_json.message_type(kind)
    assert cls is not None  # every name kinds.kinds() gives has a message
    schema = message_schema(cls.DESCRIPTOR, comments)
    if kind in policy_fields.POLICY_KINDS:  # the oneof member's comment, as before
        field = policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind]
        description = _clean(comments.get(field.full_name, "")) or schema.get("description", "")
        if description:
            schema["description"] = description
    return schema
