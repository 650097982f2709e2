"""The one place that maps a policy kind to its package: every kind's spec and the path of the
worker-side class that runs it.

A process-wide table on purpose: every process (operator, router, worker) must read a policy the
same way, so its kinds are found once: the built-in packages listed here (when this module is
imported), then, at the first lookup, the packages installed with a ``gearshift.policies`` entry
point (``mine = my_policy.spec:SPEC``) and those named in ``GEARSHIFT_POLICY_PACKAGES``
(comma-separated packages, each with a ``spec.py`` holding ``SPEC``), and ``register_spec`` (a
test's). Adding a technique is adding its package and one line (here, or its entry point).

Torch-free: a kind's worker-side ``Policy`` class is imported only by ``registry.make_policy``.
"""

from __future__ import annotations

import importlib
import os
import re
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.spec import PolicySpec

if TYPE_CHECKING:
    from gearshift.worker.policies.base import Policy

BUILTIN = (
    "gearshift.worker.policies.static",
    "gearshift.worker.policies.shift",
    "gearshift.worker.policies.seesaw",
    "gearshift.worker.policies.sidp",
    "gearshift.worker.policies.tetris",
)
ENTRY_POINT_GROUP = "gearshift.policies"
PACKAGES_ENV = "GEARSHIFT_POLICY_PACKAGES"
_NAME = re.compile(r"^[a-z][a-zA-Z0-9]*$")
_V1 = frozenset(policy_fields.POLICY_KINDS)

_SPECS: dict[str, PolicySpec] = {}
# The worker-side class of each kind: its spec's "module:Class" until make_policy imports it,
# or a class ``registry.register`` put there (a test's stand-in).
RUNTIMES: dict[str, type[Policy] | str] = {}
_plugins_loaded = False


def load_ref(ref: str) -> Any:
    """The object a "module:attribute" path names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_spec(spec: PolicySpec) -> PolicySpec:
    """Add a policy kind: a built-in one, a package's, or a test's."""
    if spec.kind in _V1:
        field = policy_pb2.Policy.DESCRIPTOR.fields_by_name[spec.kind]
        if field.message_type is not spec.message.DESCRIPTOR:
            raise ValueError(f"{spec.kind!r} is gearshift.v1.Policy's {field.message_type.name}")
    elif spec.kind == policy_fields.PLUGIN_FIELD or not _NAME.match(spec.kind):
        raise ValueError(f"{spec.kind!r} cannot name a policy kind (lowerCamel letters, digits)")
    elif spec.message.DESCRIPTOR.file.package == "gearshift.v1":
        raise ValueError(f"the package of policy {spec.kind!r} must bring its own message")
    if _SPECS.get(spec.kind, spec) is not spec:
        raise ValueError(f"policy kind {spec.kind!r} is registered twice")
    _SPECS[spec.kind] = spec
    RUNTIMES.setdefault(spec.kind, spec.runtime)
    return spec


def unregister_spec(kind: str) -> None:
    _SPECS.pop(kind, None)
    RUNTIMES.pop(kind, None)


for _package in BUILTIN:
    register_spec(importlib.import_module(f"{_package}.spec").SPEC)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        spec = entry.load()
        if not isinstance(spec, PolicySpec) or spec.kind != entry.name:
            raise InvalidRequestError(
                ENTRY_POINT_GROUP,
                f"entry point {entry.name} = {entry.value} is not the PolicySpec of kind "
                f"{entry.name!r}",
            )
        register_spec(spec)
    for package in filter(None, (p.strip() for p in os.environ.get(PACKAGES_ENV, "").split(","))):
        try:
            spec = importlib.import_module(f"{package}.spec").SPEC
        except (ImportError, AttributeError) as exc:
            raise InvalidRequestError(
                PACKAGES_ENV, f"{PACKAGES_ENV}: {package}.spec has no SPEC ({exc})"
            ) from exc
        if _SPECS.get(spec.kind) is not spec:
            register_spec(spec)


def specs() -> tuple[PolicySpec, ...]:
    """Every known kind's spec: gearshift.v1's in the oneof's order, then packages' by kind."""
    _load_plugins()
    own = [_SPECS[k] for k in policy_fields.POLICY_KINDS if k in _SPECS]
    others = sorted((s for s in _SPECS.values() if s.kind not in _V1), key=lambda s: s.kind)
    return (*own, *others)


def spec_of(kind: str) -> PolicySpec | None:
    """The spec of ``kind``; None for an unknown kind or one the operator plans (``auto``)."""
    _load_plugins()
    return _SPECS.get(kind)


def kinds() -> tuple[str, ...]:
    """Every key ``spec.policy`` may hold: gearshift.v1's kinds (``auto`` too), then packages'."""
    return (*policy_fields.POLICY_KINDS, *(s.kind for s in specs() if s.kind not in _V1))


def planned(kind: str) -> bool:
    """A gearshift.v1 kind without a spec (``auto``): the operator plans it into one with."""
    return kind in _V1 and spec_of(kind) is None
