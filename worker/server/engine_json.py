"""engine.json, the operator's contract with the worker, as one typed document.

Written by the operator (``reconcile/render_config.py``) and ``gearshift serve``, read by
``gearshift worker`` (``settings.py``); docs/operator.md describes it. Importing this module
pulls in no torch, so the operator can. JSON keys are the fields' names in camelCase
(``max_model_len`` is ``maxModelLen``). An unknown key, or a value of the wrong type, is refused
naming its path (``engine.json: model.maxModelLen: ...``): a key the worker does not know is an
option it would silently not apply.

To add an option, add a field with a default to the dataclass it belongs to; writing, reading
and the refusal of wrong types follow from the annotation.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gearshift.worker.errors import InvalidRequestError

T = TypeVar("T")


@dataclass(frozen=True)
class ModelJson:
    """The model the group serves."""

    path: str = ""  # where the worker reads it (a folder, a .gguf file or a known name)
    name: str = ""  # the served model name ("": derived from the path)
    source: str | None = None  # the deployment's model URI (hf://, pvc://, ...), for people
    dtype: str = "auto"
    max_model_len: int | None = None
    # Written only when not auto: a deployment that never set it keeps its engine.json (its
    # revision, so its pods) across an operator upgrade.
    attention_backend: str = field(default="auto", metadata={"omit_default": True})


@dataclass(frozen=True)
class GroupJson:
    """The worker group's size: ``ranks`` = ``nodes`` × ``gpusPerNode``."""

    nodes: int = 1
    gpus_per_node: int = 1
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.ranks != self.nodes * self.gpus_per_node:
            raise InvalidRequestError(
                "config",
                f"group.ranks must be nodes × gpusPerNode ({self.nodes} × "
                f"{self.gpus_per_node}), got {self.ranks}",
            )


@dataclass(frozen=True)
class PortsJson:
    """The ports the operator's Services expose."""

    worker: int = 0  # gearshift.v1.Worker on the leader (0: the default port)
    rendezvous: int = 0  # torch.distributed's store (the pods read GEARSHIFT_GROUP_PORT)


@dataclass(frozen=True)
class EngineJson:
    """What every worker rank reads at start (``--config`` or ``$GEARSHIFT_CONFIG``)."""

    deployment: str = ""
    namespace: str | None = None
    engine: str = "gearshift"  # "vllm" deployments run vLLM's server, which reads none of this
    model: ModelJson = field(default_factory=ModelJson)
    group: GroupJson = field(default_factory=GroupJson)
    ports: PortsJson | None = None
    # gearshift.v1.Policy in the proto's JSON form, defaults filled (json_format.ParseDict).
    policy: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, every key written (None as null) but defaults marked omit_default."""
        return _write(self)

    def dumps(self, indent: int | None = None) -> str:
        """The file's text."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, where: str = "engine.json") -> EngineJson:
        """Read a parsed JSON object; InvalidRequestError naming the first bad key."""
        return _read(cls, data, where, "")

    @classmethod
    def load(cls, path: str | Path) -> EngineJson:
        """Read the file at ``path``; InvalidRequestError("config", ...) if it cannot be."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidRequestError("config", f"cannot read {path}: {exc}") from exc
        return cls.from_dict(data, str(path))


def json_key(name: str) -> str:
    """A field's JSON key: ``gpus_per_node`` -> ``gpusPerNode``."""
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _write(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            json_key(f.name): _write(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get("omit_default") and getattr(value, f.name) == f.default)
        }
    return value


def _read(cls: type[T], data: Any, where: str, prefix: str) -> T:
    if not isinstance(data, Mapping):
        what = prefix.rstrip(".") or "the file"
        raise InvalidRequestError("config", f"{where}: {what}: expected an object")
    hints = typing.get_type_hints(cls)
    fields = {json_key(f.name): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        keys = ", ".join(f"{prefix}{k}" for k in unknown)
        raise InvalidRequestError("config", f"{where}: unknown key {keys}")
    values = {
        fields[key].name: _value(hints[fields[key].name], raw, where, f"{prefix}{key}")
        for key, raw in data.items()
    }
    try:
        return cls(**values)
    except InvalidRequestError as exc:  # the dataclass's own cross-field checks
        raise InvalidRequestError("config", f"{where}: {exc.message}") from exc


def _value(tp: Any, raw: Any, where: str, path: str) -> Any:
    args = typing.get_args(tp)
    if raw is None and type(None) in args:
        return None
    if type(None) in args:  # X | None: X
        tp = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return _read(tp, raw, where, f"{path}.")  # type: ignore[arg-type]
    expected = typing.get_origin(tp) or tp
    if expected is float and type(raw) is int:
        return float(raw)
    # bool is an int to Python, never to engine.json.
    if not isinstance(raw, expected) or (isinstance(raw, bool) and expected is not bool):
        shown = json.dumps(raw)[:60]
        raise InvalidRequestError("config", f"{where}: {path}: expected {_name(tp)}, got {shown}")
    return raw


def _name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is dict:
        return "an object"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(
        tp, str(tp)
    )
