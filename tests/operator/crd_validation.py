"""Validate a custom resource the way the API server would, without one.

1. Defaulting from the structural schema (`default:`), as the API server does before validation.
2. The openAPIV3Schema as JSON Schema, with kubectl's strict field validation (unknown fields are
   errors: `additionalProperties: false` wherever properties are listed) and the x-kubernetes-*
   extensions translated (int-or-string, preserve-unknown-fields).
3. Every x-kubernetes-validations CEL rule, evaluated with cel-python on the defaulted object;
   `number` fields are floats, as the API server types them.
Errors name the field: "spec.policy.shift: sp × tp must equal ...".
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def version_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return dict(v["schema"]["openAPIV3Schema"])
    raise KeyError(version)


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("default", "description"):
            continue
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(v) for v in value]
        else:
            out[key] = value
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _typed(schema: dict[str, Any], value: Any) -> Any:
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: _typed(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items", {}), v) for v in value]
    return value


def _cel_errors(schema: dict[str, Any], value: Any, path: str, env: celpy.Environment) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception as exc:  # noqa: BLE001 - a CEL runtime error rejects the object
            ok, rule = False, {**rule, "message": f"{rule.get('message', '')} ({exc})"}
        if not ok:
            where = (path + rule.get("fieldPath", "")).lstrip(".")
            message = rule.get("message", rule["rule"])
            errors.append(f"{where}: {message}" if where else message)
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += _cel_errors(sub, value[name], f"{path}.{name}", env)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]", env)
    return errors


def validate(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Every reason the API server would reject `obj`; empty when it would accept it."""
    schema = version_schema(crd)
    value = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if errors:
        return errors  # CEL runs only on objects that pass the schema, as in the API server
    return _cel_errors(schema, _typed(schema, value), "", celpy.Environment())
