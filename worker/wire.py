"""Typed messages across a process pipe: a closed set of dataclasses as JSON, never pickle.

A ``Codec`` is built from a protocol's message classes. The types their fields may hold are
read from the annotations (scalars, ``None``, enums, ``Literal``s, lists, tuples, mappings,
protobuf messages and further dataclasses) and nothing else: an annotation the codec cannot
check (``Any``, ``object``, a plain class) is refused when the codec is built, a value of the
wrong type when a message is encoded or decoded. Decoding builds nothing but those dataclasses
(through their ``__init__``, so their own checks run), which unpickling cannot promise.

On the wire a dataclass is ``[name, field values in declaration order]``; both ends of a pipe
run the same code, so the order is the schema. A mapping with non-string keys is a list of
pairs; ``bytes`` and a protobuf message's serialised bytes are base64 text. NaN and infinities
pass (a logprob may be -inf).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

M = TypeVar("M")
Convert = Callable[[Any], Any]
_EXACT: tuple[type, ...] = (bool, int, str)  # JSON gives these back as they were sent


class WireError(ValueError):
    """A message the codec refuses: a type it does not carry, or bytes that are not one."""


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one annotation travels."""

    encode: Convert | None  # None: the value is JSON as it is
    decode: Convert  # checks (and converts) what arrived; raises WireError
    json_kind: type  # what it travels as: list, dict, str, ... (object: several)
    exact: type | None = None  # a value of this type arrives unchanged and needs no check


def _fail(what: str, value: Any) -> WireError:
    return WireError(f"expected {what}, got {repr(value)[:80]}")


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _one_kind(kinds: Iterable[type]) -> type:
    found = set(kinds)
    return found.pop() if len(found) == 1 else object


def _scalar(tp: type) -> _Shape:
    if tp is float:

        def number(x: Any) -> Any:
            if type(x) is float or type(x) is int:  # 1.0 may arrive as 1
                return float(x)
            raise _fail("a number", x)

        return _Shape(None, number, float)

    def check(x: Any) -> Any:
        if type(x) is not tp:
            raise _fail("null" if tp is type(None) else tp.__name__, x)
        return x

    return _Shape(None, check, tp, tp)


def _bytes() -> _Shape:
    def decode(x: Any) -> Any:
        if type(x) is not str:
            raise _fail("base64 bytes", x)
        try:
            return base64.b64decode(x, validate=True)
        except ValueError:
            raise _fail("base64 bytes", x) from None

    def encode(v: Any) -> Any:
        if type(v) is not bytes:
            raise _fail("bytes", v)
        return base64.b64encode(v).decode("ascii")

    return _Shape(encode, decode, str)


def _field_error(name: str, shapes: list[tuple[str, _Shape]], x: list[Any]) -> WireError:
    """The first refused field of a record, named (found again: the fast path keeps no track)."""
    for (field, shape), value in zip(shapes, x[1:], strict=True):
        try:
            shape.decode(value)
        except WireError as exc:
            return WireError(f"{name}.{field}: {exc}")
    return WireError(f"{name}: refused")


def _record(cls: type, shapes: list[tuple[str, _Shape]]) -> tuple[Convert, Convert]:
    """Straight-line encode and decode of one dataclass, generated as dataclasses generates
    ``__init__``: a loop over the fields costs about twice as much per message."""
    env: dict[str, Any] = {"cls": cls, "shapes": shapes, "WireError": WireError}
    env.update(_fail=_fail, _field_error=_field_error)
    written, read = [], []
    for i, (field, shape) in enumerate(shapes, 1):
        env[f"e{i}"], env[f"d{i}"], env[f"t{i}"] = shape.encode, shape.decode, shape.exact
        written.append(f"v.{field}" if shape.encode is None else f"e{i}(v.{field})")
        if shape.exact is None:
            read.append(f"d{i}(x[{i}])")
        else:  # the common case inline; the reader refuses the rest
            read.append(f"(x[{i}] if type(x[{i}]) is t{i} else d{i}(x[{i}]))")
    name = cls.__name__
    source = f"""
def encode(v):
    if type(v) is not cls:
        raise _fail({name!r}, v)
    return [{name!r}, {", ".join(written)}]

def decode(x):
    if type(x) is not list or len(x) != {len(shapes) + 1} or x[0] != {name!r}:
        raise _fail("a " + {name!r}, x)
    try:
        return cls({", ".join(read)})
    except WireError:
        raise _field_error({name!r}, shapes, x) from None
    except (TypeError, ValueError) as exc:
        raise WireError({name!r} + ": " + str(exc)) from exc
"""
    exec(source, env)  # our own text, from a dataclass's field names and no input
    return env["encode"], env["decode"]


class Codec(Generic[M]):
    """Encode and decode one direction of a protocol; ``messages`` are the classes it carries."""

    def __init__(self, messages: Iterable[type], namespace: Mapping[str, Any] | None = None):
        # ``namespace``: names the messages' modules import only while type checking.
        self._namespace = dict(namespace or {})
        self._classes: dict[str, type] = {}
        self._shapes: dict[type, _Shape] = {}
        self._building: set[type] = set()
        self._messages = {cls.__name__: self._dataclass(cls) for cls in messages}

    def encode(self, message: M) -> bytes:
        """The message as bytes; WireError if it is not one of the codec's messages."""
        name = type(message).__name__
        if name not in self._messages or self._classes[name] is not type(message):
            raise WireError(f"{name} is not a message of this protocol")
        encode = self._messages[name].encode
        assert encode is not None
        try:
            return json.dumps(encode(message), separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise WireError(f"{name}: {exc}") from exc

    def decode(self, data: bytes) -> M:
        """The message in ``data``; WireError saying what is wrong with it."""
        try:
            tree = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nesting too deep too
            raise WireError(f"not a message: {exc}") from exc
        if type(tree) is not list or not tree or tree[0] not in self._messages:
            raise WireError(f"not a message of this protocol: {str(tree)[:80]}")
        message: M = self._messages[tree[0]].decode(tree)
        return message

    def send(self, conn: Connection, message: M) -> None:
        """Encode ``message`` and send it as one frame."""
        conn.send_bytes(self.encode(message))

    def recv(self, conn: Connection) -> M:
        """Receive one frame and decode it (EOFError/OSError when the pipe is gone)."""
        return self.decode(conn.recv_bytes())

    # ---- shapes of annotations -------------------------------------------------------------

    def _shape(self, tp: Any) -> _Shape:
        if tp is None or tp in (type(None), *_EXACT, float):
            return _scalar(type(None) if tp is None else tp)
        if tp is bytes:
            return _bytes()
        origin = typing.get_origin(tp)
        if origin is typing.Union or origin is types.UnionType:
            return self._union(typing.get_args(tp))
        if origin is typing.Literal:
            return self._literal(typing.get_args(tp))
        if origin in (list, tuple, Sequence):
            return self._sequence(origin, typing.get_args(tp))
        if origin in (dict, Mapping):
            return self._mapping(*typing.get_args(tp))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self._enum(tp)
        if isinstance(tp, type) and issubclass(tp, ProtoMessage):
            return self._proto(tp)
        if _is_record(tp):
            return self._dataclass(tp)
        raise TypeError(f"the wire codec cannot carry {tp!r}")

    def _dataclass(self, cls: type) -> _Shape:
        if cls in self._shapes:
            return self._shapes[cls]
        if cls in self._building:
            raise TypeError(f"the wire codec cannot carry recursive {cls.__name__}")
        if self._classes.setdefault(cls.__name__, cls) is not cls:
            raise TypeError(f"two classes named {cls.__name__} in one protocol")
        self._building.add(cls)
        module = vars(sys.modules[cls.__module__])
        hints = typing.get_type_hints(cls, globalns={**module, **self._namespace})
        shapes = [(f.name, self._shape(hints[f.name])) for f in dataclasses.fields(cls) if f.init]
        self._building.discard(cls)
        shape = _Shape(*_record(cls, shapes), list)
        self._shapes[cls] = shape
        return shape

    def _union(self, args: tuple[Any, ...]) -> _Shape:
        shapes = [self._shape(a) for a in args]
        by_kind: dict[type, list[tuple[Any, _Shape]]] = {}
        for arg, shape in zip(args, shapes, strict=True):
            by_kind.setdefault(shape.json_kind, []).append((arg, shape))
        # One reading per JSON type; dataclasses share lists, told apart by their name.
        for members in by_kind.values():
            if len(members) > 1 and not all(_is_record(a) for a, _ in members):
                raise TypeError(f"the wire codec cannot tell apart {[a for a, _ in members]}")
        records = {a.__name__: s for a, s in by_kind.get(list, ()) if _is_record(a)}
        readers = {kind: members[0][1].decode for kind, members in by_kind.items()}
        if float in readers and int not in readers:
            readers[int] = readers[float]
        what = " | ".join(a.__name__ if isinstance(a, type) else str(a) for a in args)

        def decode(x: Any) -> Any:
            if records and type(x) is list and x and x[0] in records:
                return records[x[0]].decode(x)
            reader = readers.get(type(x))
            if reader is None:
                raise _fail(what, x)
            return reader(x)

        # Encoding picks a member by the value's class (a generic alias by its origin).
        by_class: dict[type, Convert | None] = {}
        for arg, shape in zip(args, shapes, strict=True):
            if typing.get_origin(arg) is typing.Literal:
                by_class.update({type(v): None for v in typing.get_args(arg)})
            else:
                by_class.setdefault(typing.get_origin(arg) or arg, shape.encode)
        kind = _one_kind(by_kind)
        if all(e is None for e in by_class.values()):
            return _Shape(None, decode, kind)

        def encode(v: Any) -> Any:
            if type(v) in by_class:
                convert = by_class[type(v)]
            else:
                found = [c for cls, c in by_class.items() if isinstance(v, cls)]
                if not found:
                    raise _fail(what, v)
                convert = found[0]
            return v if convert is None else convert(v)

        return _Shape(encode, decode, kind)

    def _literal(self, values: tuple[Any, ...]) -> _Shape:
        allowed = set(values)

        def check(x: Any) -> Any:
            if type(x) not in (*_EXACT, float) or x not in allowed:
                raise _fail(f"one of {sorted(map(str, allowed))}", x)
            return x

        return _Shape(None, check, _one_kind(type(v) for v in values))

    def _sequence(self, origin: Any, args: tuple[Any, ...]) -> _Shape:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return self._fixed_tuple([self._shape(a) for a in args])
        make = list if origin is list else tuple
        item = self._shape(args[0])
        read, write, exact = item.decode, item.encode, item.exact

        def decode(x: Any) -> Any:
            if type(x) is not list:
                raise _fail("a list", x)
            if exact is not None and all(type(v) is exact for v in x):
                return x if make is list else tuple(x)
            return make(read(v) for v in x)

        def encode(v: Any) -> Any:
            assert write is not None
            return [write(i) for i in v]

        return _Shape(None if write is None else encode, decode, list)

    def _fixed_tuple(self, fixed: list[_Shape]) -> _Shape:
        def decode(x: Any) -> Any:
            if type(x) is not list or len(x) != len(fixed):
                raise _fail(f"a list of {len(fixed)}", x)
            return tuple(s.decode(v) for s, v in zip(fixed, x, strict=True))

        def encode(v: Any) -> Any:
            return [i if s.encode is None else s.encode(i) for s, i in zip(fixed, v, strict=True)]

        plain = all(s.encode is None for s in fixed)
        return _Shape(None if plain else encode, decode, list)

    def _mapping(self, key: Any, value: Any) -> _Shape:
        read_k, read_v, write_v = self._shape(key).decode, *_parts(self._shape(value))
        if key is str:

            def decode(x: Any) -> Any:
                if type(x) is not dict:
                    raise _fail("an object", x)
                return {read_k(k): read_v(v) for k, v in x.items()}

            def encode(v: Any) -> Any:
                # json.dumps would turn other keys into strings without a word.
                if not all(type(k) is str for k in v):
                    raise _fail("string keys", list(v))
                return v if write_v is None else {k: write_v(i) for k, i in v.items()}

            return _Shape(encode, decode, dict)

        def decode_pairs(x: Any) -> Any:
            if type(x) is not list or not all(type(p) is list and len(p) == 2 for p in x):
                raise _fail("a list of pairs", x)
            return {read_k(k): read_v(v) for k, v in x}

        def encode_pairs(v: Any) -> Any:
            return [[k, i if write_v is None else write_v(i)] for k, i in v.items()]

        return _Shape(encode_pairs, decode_pairs, list)

    def _enum(self, cls: type[enum.Enum]) -> _Shape:
        def decode(x: Any) -> Any:
            try:
                return cls(x)
            except ValueError:
                raise _fail(cls.__name__, x) from None

        def encode(v: Any) -> Any:
            if not isinstance(v, cls):
                raise _fail(cls.__name__, v)
            return v.value

        return _Shape(encode, decode, _one_kind(type(m.value) for m in cls))

    def _proto(self, cls: type[ProtoMessage]) -> _Shape:
        def decode(x: Any) -> Any:
            if type(x) is not str:
                raise _fail(cls.__name__, x)
            try:
                return cls.FromString(base64.b64decode(x, validate=True))
            except (DecodeError, ValueError) as exc:
                raise WireError(f"{cls.__name__}: {exc}") from None

        def encode(v: Any) -> Any:
            if not isinstance(v, cls):
                raise _fail(cls.__name__, v)
            return base64.b64encode(v.SerializeToString()).decode("ascii")

        return _Shape(encode, decode, str)


def _parts(shape: _Shape) -> tuple[Convert, Convert | None]:
    return shape.decode, shape.encode
