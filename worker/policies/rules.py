"""The rules a policy spec states once: evaluated in Python on a policy message (the worker, the
operator, `serve`) and rendered to CEL for the CRD (the API server), so the two cannot disagree.

A rule is a small expression over the policy message's fields, the group's GPU count ``G`` and
constants: ``+ - * /`` (``/`` is CEL's integer division: it truncates toward zero), comparisons,
``&`` (and), ``|`` (or), ``~`` (not) and ``greatest``. Python evaluates it on a message whose
defaults are filled (``checks.with_defaults``); CEL reads the stored object, where nothing is
defaulted, so a field renders as "the field, or its default when unset", the default being the
proto's ``default_value`` option, the spec's derived default, or the proto3 zero value.

Rules read numbers and booleans only (an enum is a string in the CRD and an int in Python).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gearshift.v1 import policy_fields

Number = int | float | bool

_FLOATS = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
_UNSIGNED = (FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64)


class PyEnv(NamedTuple):
    """What a rule reads in Python: a defaults-filled message and the group's GPUs."""

    message: Message
    gpus: int


@dataclass(frozen=True)
class CelEnv:
    """What a rule renders against in CEL: where the message sits in the object (``root``, e.g.
    ``self.policy.shift``), the CEL for G, the message's descriptor and its derived defaults."""

    root: str
    gpus: str
    descriptor: Descriptor
    derived: Mapping[str, Expr]


def _operator(symbol: str) -> Callable[[Expr, Expr | Number], Expr]:
    """``a + b``, ``a < b``, ``a & b`` ... build rules (``same(a, b)`` is ``==``: Python's ``==``
    stays the rules' own equality)."""

    def build(self: Expr, other: Expr | Number) -> Expr:
        return Binary(symbol, self, lift(other))

    return build


class Expr:
    """A rule or one of its terms."""

    __add__ = _operator("+")
    __sub__ = _operator("-")
    __mul__ = _operator("*")
    __truediv__ = _operator("/")
    __lt__ = _operator("<")
    __le__ = _operator("<=")
    __gt__ = _operator(">")
    __ge__ = _operator(">=")
    __and__ = _operator("&&")
    __or__ = _operator("||")

    def value(self, env: PyEnv) -> Number:
        raise NotImplementedError

    def cel(self, env: CelEnv) -> str:
        raise NotImplementedError

    def text(self, scope: str = "") -> str:
        """Its arithmetic in the CRD's field names, relative to the sub-message ``scope``."""
        raise NotImplementedError

    def nonnegative(self, desc: Descriptor) -> bool:
        """Whether it is never below 0 in a message of ``desc`` (then a stored default needs
        no clamp, and the CEL stays short)."""
        return False

    def __invert__(self) -> Expr:
        return Not(self)


def lift(value: Expr | Number) -> Expr:
    return value if isinstance(value, Expr) else Const(value)


def same(a: Expr | Number, b: Expr | Number) -> Expr:
    """``a == b`` (``==`` itself stays Python's identity-free equality of rules)."""
    return Binary("==", lift(a), lift(b))


def greatest(a: Expr | Number, b: Expr | Number) -> Expr:
    return Greatest(lift(a), lift(b))


def _literal(value: Number) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if "." in repr(value) or "e" in repr(value) else f"{value}.0"
    return str(value)


@dataclass(frozen=True, eq=False)
class Const(Expr):
    v: Number

    def value(self, env: PyEnv) -> Number:
        return self.v

    def cel(self, env: CelEnv) -> str:
        return _literal(self.v)

    def text(self, scope: str = "") -> str:
        return str(self.v)

    def nonnegative(self, desc: Descriptor) -> bool:
        return self.v >= 0


@dataclass(frozen=True, eq=False)
class GroupGpus(Expr):
    """G: the group's GPUs (ranks), nodes × GPUs per node."""

    def value(self, env: PyEnv) -> Number:
        return env.gpus

    def cel(self, env: CelEnv) -> str:
        return env.gpus

    def text(self, scope: str = "") -> str:
        return "G"

    def nonnegative(self, desc: Descriptor) -> bool:
        return True


G = GroupGpus()


def field_path(descriptor: Descriptor, path: str) -> list[FieldDescriptor]:
    """The descriptors along a dotted proto path ("prefill.tp")."""
    out = []
    desc: Descriptor | None = descriptor
    for name in path.split("."):
        if desc is None or name not in desc.fields_by_name:
            raise KeyError(f"{descriptor.full_name} has no field {path!r}")
        out.append(desc.fields_by_name[name])
        desc = out[-1].message_type
    return out


def json_path(descriptor: Descriptor, path: str) -> str:
    """A proto path in the CRD's (JSON) names: "was_cache_slots" -> "wasCacheSlots"."""
    return ".".join(f.json_name for f in field_path(descriptor, path))


@dataclass(frozen=True, eq=False)
class Field(Expr):
    """A field of the policy message, by proto path ("tp", "prefill.pp")."""

    path: str

    def value(self, env: PyEnv) -> Number:
        target: Any = env.message
        for name in self.path.split("."):
            target = getattr(target, name)
        return target

    def cel(self, env: CelEnv) -> str:
        chain = field_path(env.descriptor, self.path)
        leaf = chain[-1]
        if leaf.cpp_type in (FieldDescriptor.CPPTYPE_ENUM, FieldDescriptor.CPPTYPE_STRING):
            raise ValueError(f"rules read numbers and booleans; {self.path} is not one")
        selectors, guards = env.root, []
        for f in chain:
            selectors = f"{selectors}.{f.json_name}"
            guards.append(f"has({selectors})")
        return f"({' && '.join(guards)} ? {selectors} : {default_cel(env, self.path, leaf)})"

    def nonnegative(self, desc: Descriptor) -> bool:
        leaf = field_path(desc, self.path)[-1]
        lo, _ = policy_fields.bounds(leaf)
        return leaf.cpp_type in _UNSIGNED or (lo is not None and lo >= 0)

    def text(self, scope: str = "") -> str:
        name = self.path.removeprefix(f"{scope}.") if scope else self.path
        # The CRD's names, which messages quote: snake_case proto paths become lowerCamel.
        head, *rest = name.split("_")
        return head + "".join(p.title() for p in rest)


def default_cel(env: CelEnv, path: str, leaf: FieldDescriptor) -> str:
    """CEL for an unset field's value: derived default, constant default, or zero."""
    derived = env.derived.get(path)
    if derived is not None:
        return stored(derived, leaf, env.descriptor).cel(env)
    text = policy_fields.default_text(leaf)
    if leaf.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        return "true" if text == "true" else "false"
    number = float(text) if text else 0.0
    return _literal(number if leaf.cpp_type in _FLOATS else int(number))


def stored(expr: Expr, leaf: FieldDescriptor, desc: Descriptor) -> Expr:
    """A derived default as its field holds it: an unsigned field cannot hold a negative value,
    so both sides clamp one that may be negative at 0."""
    if leaf.cpp_type in _UNSIGNED and not expr.nonnegative(desc):
        return greatest(expr, 0)
    return expr


def _truncating_div(a: Number, b: Number) -> Number:
    # CEL's int division truncates toward zero; a zero divisor is a CEL error, which rejects the
    # object, and 0 here, which makes every layout rule that uses it fail too.
    if b == 0:
        return 0
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    q = abs(int(a)) // abs(int(b))
    return q if (a >= 0) == (b > 0) else -q


_PY: dict[str, Callable[[Any, Any], Number]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _truncating_div,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
}
_TEXT = {"*": "×", "/": "/", "+": "+", "-": "-"}


@dataclass(frozen=True, eq=False)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr

    def value(self, env: PyEnv) -> Number:
        if self.op == "&&":
            return bool(self.a.value(env)) and bool(self.b.value(env))
        if self.op == "||":
            return bool(self.a.value(env)) or bool(self.b.value(env))
        return _PY[self.op](self.a.value(env), self.b.value(env))

    def cel(self, env: CelEnv) -> str:
        return f"({self.a.cel(env)} {self.op} {self.b.cel(env)})"

    def nonnegative(self, desc: Descriptor) -> bool:
        return self.op in ("*", "/", "+") and self.a.nonnegative(desc) and self.b.nonnegative(desc)

    def text(self, scope: str = "") -> str:
        if self.op not in _TEXT:
            raise ValueError(f"{self.op!r} has no arithmetic text")
        return f"{self.a.text(scope)} {_TEXT[self.op]} {self.b.text(scope)}"


@dataclass(frozen=True, eq=False)
class Not(Expr):
    a: Expr

    def value(self, env: PyEnv) -> Number:
        return not self.a.value(env)

    def cel(self, env: CelEnv) -> str:
        return f"!{self.a.cel(env)}"

    def text(self, scope: str = "") -> str:
        raise ValueError("a negation has no arithmetic text")


@dataclass(frozen=True, eq=False)
class Greatest(Expr):
    a: Expr
    b: Expr

    def value(self, env: PyEnv) -> Number:
        return max(self.a.value(env), self.b.value(env))

    def cel(self, env: CelEnv) -> str:
        a, b = self.a.cel(env), self.b.cel(env)
        return f"({a} > {b} ? {a} : {b})"

    def text(self, scope: str = "") -> str:
        return f"max({self.a.text(scope)}, {self.b.text(scope)})"

    def nonnegative(self, desc: Descriptor) -> bool:
        return self.a.nonnegative(desc) or self.b.nonnegative(desc)
