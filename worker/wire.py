"""Typed messages between processes without pickle: JSON of known frozen dataclasses.

A ``Wire`` is built from the dataclasses one protocol speaks. ``encode`` writes a message as
JSON (its type's name and its fields, each written as its type hint says); ``decode`` refuses
anything that is not JSON naming one of those types with exactly their fields, each of its
hinted type (``WireError``). Nothing received is ever unpickled, so a peer that can reach a
connection (a control listener across nodes) can make the receiver build only these values.

Field types a wire carries: ``None``, ``bool``, ``int``, ``float``, ``str``, enums, ``Literal``,
unions (tried in order), ``tuple``/``list``/``Sequence``, ``dict``/``Mapping`` (as pairs, so keys
keep their type) and nested dataclasses named in ``nested``. A hint outside these (``Any``, a
tensor) makes the ``Wire`` refuse the type when it is built, not when a message is sent.

A ``Link`` wraps a ``multiprocessing`` connection (a pipe, or a ``Client``/``Listener`` socket)
and moves a wire's messages with ``send_bytes``/``recv_bytes``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import json
import threading
import types
import typing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["Link", "Wire", "WireError", "wait_links"]


class WireError(ValueError):
    """Bytes that are not a message of this wire (unknown type, missing or extra fields, a
    value of the wrong type), or a message type the wire cannot carry."""


Encode = Callable[[object], object]
Decode = Callable[[object], object]


def _strict_int(x: object) -> int:
    if type(x) is not int:
        raise WireError(f"expected an integer, got {type(x).__name__}")
    return x


def _strict_float(x: object) -> float:
    if type(x) not in (int, float):
        raise WireError(f"expected a number, got {type(x).__name__}")
    return float(x)  # type: ignore[arg-type]


def _exact(kind: type) -> Decode:
    def check(x: object) -> object:
        if type(x) is not kind:
            raise WireError(f"expected {kind.__name__}, got {type(x).__name__}")
        return x

    return check


def _items(x: object) -> list[object]:
    if type(x) is not list:
        raise WireError(f"expected a list, got {type(x).__name__}")
    return x


class Wire:
    """The messages of one protocol; see the module docstring."""

    def __init__(self, messages: Sequence[type], nested: Sequence[type] = ()) -> None:
        """``messages``: the dataclasses sent on their own; ``nested``: dataclasses that only
        appear inside them (and the names their hints use under ``TYPE_CHECKING``)."""
        known = [*messages, *nested]
        self._names = {t.__name__: t for t in known}
        if len(self._names) != len(known):
            raise WireError("two message types share a name")
        self._fields: dict[type, list[tuple[str, Encode, Decode]]] = {}
        for kind in known:
            self._build(kind)
        self._messages = {t.__name__: t for t in messages}

    # ---- building the per-type coders -------------------------------------------------------

    def _build(self, kind: type) -> None:
        if kind in self._fields:
            return
        if not dataclasses.is_dataclass(kind):
            raise WireError(f"{kind.__name__} is not a dataclass")
        self._fields[kind] = []  # a placeholder: a type may nest itself
        try:
            hints = typing.get_type_hints(kind, localns=self._names)
        except NameError as exc:  # a dataclass its hints name that the wire was not given
            raise WireError(f"{kind.__name__}: {exc}; it must be named in nested") from exc
        self._fields[kind] = [
            (f.name, *self._coder(hints[f.name], f"{kind.__name__}.{f.name}"))
            for f in dataclasses.fields(kind)
            if f.init
        ]

    def _coder(self, hint: Any, where: str) -> tuple[Encode, Decode]:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is type(None) or hint is None:
            return (lambda x: x), _none
        if hint in (bool, str):
            return (lambda x: x), _exact(hint)
        if hint is int:
            return (lambda x: x), _strict_int
        if hint is float:
            return (lambda x: x), _strict_float
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_coder(hint)
        if origin is typing.Literal:
            return (lambda x: x), _literal(args, where)
        if origin in (typing.Union, types.UnionType):
            return self._union(args, where)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            enc, dec = self._coder(args[0], where)
            return _seq(enc), lambda x: tuple(dec(v) for v in _items(x))
        if origin is tuple:
            return self._fixed_tuple(args, where)
        if origin in (list, collections.abc.Sequence):
            enc, dec = self._coder(args[0], where)
            build = list if origin is list else tuple
            return _seq(enc), lambda x: build(dec(v) for v in _items(x))
        if origin in (dict, collections.abc.Mapping):
            return self._mapping(args, where)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if hint not in self._fields and hint.__name__ not in self._names:
                raise WireError(f"{where}: {hint.__name__} must be named in nested")
            self._build(hint)
            return self._encode_dataclass, lambda x: self._decode_dataclass(hint, x)
        raise WireError(f"{where}: a wire cannot carry {hint!r}")

    def _union(self, args: tuple[Any, ...], where: str) -> tuple[Encode, Decode]:
        arms = [(a, *self._coder(a, where)) for a in args]

        def encode(x: object) -> object:
            for arm, enc, _ in arms:
                if _is_instance(x, arm):
                    return enc(x)
            raise WireError(f"{where}: {type(x).__name__} is none of {args}")

        def decode(x: object) -> object:
            for _, _, dec in arms:
                try:
                    return dec(x)
                except (WireError, TypeError, ValueError):
                    continue
            raise WireError(f"{where}: a value of none of {args}")

        return encode, decode

    def _fixed_tuple(self, args: tuple[Any, ...], where: str) -> tuple[Encode, Decode]:
        coders = [self._coder(a, where) for a in args]

        def decode(x: object) -> object:
            items = _items(x)
            if len(items) != len(coders):
                raise WireError(f"{where}: expected {len(coders)} items, got {len(items)}")
            return tuple(dec(v) for (_, dec), v in zip(coders, items, strict=True))

        def encode(x: object) -> object:
            return [enc(v) for (enc, _), v in zip(coders, _tuple(x), strict=True)]

        return encode, decode

    def _mapping(self, args: tuple[Any, ...], where: str) -> tuple[Encode, Decode]:
        (kenc, kdec), (venc, vdec) = self._coder(args[0], where), self._coder(args[1], where)

        def encode(x: object) -> object:
            return [[kenc(k), venc(v)] for k, v in typing.cast(dict[Any, Any], x).items()]

        def decode(x: object) -> object:
            out = {}
            for pair in _items(x):
                entry = _items(pair)
                if len(entry) != 2:
                    raise WireError(f"{where}: a mapping entry is not a [key, value] pair")
                out[kdec(entry[0])] = vdec(entry[1])
            return out

        return encode, decode

    # ---- dataclasses ------------------------------------------------------------------------

    def _encode_dataclass(self, x: object) -> object:
        fields = self._fields.get(type(x))
        if fields is None:
            raise WireError(f"{type(x).__name__} is not a type of this wire")
        return {name: enc(getattr(x, name)) for name, enc, _ in fields}

    def _decode_dataclass(self, kind: type, x: object) -> object:
        if type(x) is not dict:
            raise WireError(f"{kind.__name__}: expected an object")
        fields = self._fields[kind]
        names = {name for name, _, _ in fields}
        if set(x) != names:
            raise WireError(f"{kind.__name__}: fields {sorted(x)}, expected {sorted(names)}")
        return kind(**{name: dec(x[name]) for name, _, dec in fields})

    # ---- messages ---------------------------------------------------------------------------

    @property
    def messages(self) -> tuple[type, ...]:
        """The types this wire sends on their own."""
        return tuple(self._messages.values())

    def encode(self, message: object) -> bytes:
        """``message`` as bytes; WireError for an object that is not one of the messages."""
        name = type(message).__name__
        if self._messages.get(name) is not type(message):
            raise WireError(f"{name} is not a message of this wire")
        body = {"type": name, "fields": self._encode_dataclass(message)}
        return json.dumps(body, separators=(",", ":")).encode()

    def decode(self, data: bytes) -> object:
        """The message ``data`` holds; WireError for anything else (a pickle, unknown types,
        wrong fields)."""
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise WireError("not a message: the bytes are not JSON") from exc
        if type(body) is not dict or set(body) != {"type", "fields"}:
            raise WireError("not a message: expected an object with type and fields")
        kind = self._messages.get(body["type"]) if type(body["type"]) is str else None
        if kind is None:
            raise WireError(f"unknown message type {str(body['type'])[:64]!r}")
        try:
            return self._decode_dataclass(kind, body["fields"])
        except (TypeError, ValueError) as exc:  # a constructor's own check refused a value
            raise WireError(f"{kind.__name__}: {exc}") from exc


class Link:
    """A connection that carries one wire's messages (``send_bytes``/``recv_bytes``, never
    pickle). ``send`` may be called from several threads."""

    def __init__(self, conn: Connection, wire: Wire, max_bytes: int | None = None) -> None:
        """``max_bytes``: refuse (OSError) a received message longer than this."""
        self.conn = conn
        self.wire = wire
        self.max_bytes = max_bytes
        self._send_lock = threading.Lock()

    def send(self, message: object) -> None:
        data = self.wire.encode(message)
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self) -> object:
        """The next message (blocks); WireError if it is not one of the wire's."""
        return self.wire.decode(self.conn.recv_bytes(self.max_bytes))

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def wait_links(links: Sequence[Link], timeout: float) -> list[Link]:
    """The links with something to read (or closed), waiting at most ``timeout`` seconds."""
    by_conn = {id(link.conn): link for link in links}
    return [by_conn[id(c)] for c in wait([link.conn for link in links], timeout)]


def _none(x: object) -> None:
    if x is not None:
        raise WireError(f"expected null, got {type(x).__name__}")


def _literal(values: tuple[Any, ...], where: str) -> Decode:
    def check(x: object) -> object:
        if not any(type(x) is type(v) and x == v for v in values):
            raise WireError(f"{where}: {x!r} is not one of {values}")
        return x

    return check


def _enum_coder(kind: type[enum.Enum]) -> tuple[Encode, Decode]:
    def decode(x: object) -> object:
        try:
            return kind(x)
        except ValueError as exc:
            raise WireError(f"{x!r} is not a {kind.__name__}") from exc

    return (lambda x: typing.cast(enum.Enum, x).value), decode


def _seq(enc: Encode) -> Encode:
    return lambda x: [enc(v) for v in typing.cast(Sequence[object], x)]


def _tuple(x: object) -> tuple[object, ...]:
    return tuple(typing.cast(Sequence[object], x))


def _is_instance(x: object, hint: Any) -> bool:
    if hint is type(None) or hint is None:
        return x is None
    if hint is int:
        return type(x) is int
    if hint is float:
        return type(x) in (int, float)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return x in typing.get_args(hint)
    if origin is not None:
        return isinstance(x, origin)
    return isinstance(x, hint)
