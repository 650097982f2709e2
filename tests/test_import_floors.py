"""The floors docs/architecture.md draws, enforced on the source (AST: every import, at module
level, inside functions and under TYPE_CHECKING alike).

- worker/: a module imports only its own floor and those below it (``FLOORS``); a policy
  package imports no other policy package nor what maps kinds to packages (``registry`` and its
  users); nothing imports ``gearshift.operator``.
- worker/ and operator/: nothing imports a private name (``_x``) of another package.
- The step contract table lists every public method of ``Policy``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from gearshift.worker.policies.base import Policy

ROOT = Path(__file__).resolve().parent.parent
WORKER = "gearshift.worker"

# Bottom up, as docs/architecture.md draws them (module paths under gearshift.worker; the
# longest match places a module).
FLOORS: list[tuple[str, ...]] = [
    # interfaces and the leaf libraries every floor may use
    (
        "comm",
        "errors",
        "config",
        "wire",
        "typed_collectives",
        "device_copy",
        "step_phases",
        "p2p",
        "shm_segments",
        "kv",
        "attention.core",
        "attention.metadata",
        "attention.triton.mode",  # torch-free: whether the triton backend can run here
        "kernels",
        "tokenizer",
        "structured",
        "sampling",
    ),
    ("model", "attention"),
    ("parallel",),
    ("engine",),
    ("policies",),
    ("launch",),
    ("server",),
]
# What a policy package may import of policies/ besides itself.
POLICY_SHARED = ("policies.base", "policies.gears", "policies.rules", "policies.spec")


@dataclass(frozen=True)
class Import:
    """One imported name: the module it comes from, the name (None: the module itself)."""

    importer: str  # the importing module's dotted name
    module: str
    name: str | None
    line: int


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "gearshift." + ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in ``source`` (relative ones resolved), wherever it is written."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Import(module, a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            out += [Import(module, base, a.name, node.lineno) for a in node.names]
    return out


def floor_of(module: str) -> int | None:
    """The floor of a gearshift.worker module (None: outside worker/ or unplaced)."""
    if not module.startswith(WORKER + "."):
        return None
    rest = module[len(WORKER) + 1 :].split(".")
    best: tuple[int, int] | None = None
    for floor, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            parts = prefix.split(".")
            if rest[: len(parts)] == parts and (best is None or len(parts) > best[1]):
                best = (floor, len(parts))
    return None if best is None else best[0]


def target(imp: Import, modules: set[str]) -> str:
    """The module an import reaches: ``from pkg import mod`` reaches ``pkg.mod``."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    return imp.module


def package_of(module: str, modules_with_init: set[str]) -> str:
    return module if module in modules_with_init else module.rsplit(".", 1)[0]


def policy_package(module: str) -> str | None:
    """``gearshift.worker.policies.<kind>`` for a module of a policy package."""
    parts = module.split(".")
    if parts[:3] == ["gearshift", "worker", "policies"] and len(parts) > 4:
        return ".".join(parts[:4])
    return None


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every broken rule in ``sources`` (dotted module name -> (source, is a package))."""
    modules = set(sources)
    packages = {m for m, (_, is_pkg) in sources.items() if is_pkg}
    found = []
    for module, (source, is_pkg) in sorted(sources.items()):
        own_floor = floor_of(module)
        if module.startswith(WORKER + ".") and own_floor is None:
            found.append(f"{module}: on no floor (place it in FLOORS and docs/architecture.md)")
        for imp in imports_of(source, module, is_pkg):
            where = f"{module}:{imp.line}"
            reached = target(imp, modules)
            if module.startswith(WORKER) and reached.startswith("gearshift.operator"):
                found.append(f"{where} imports {reached}: worker/ never imports operator/")
            floor = floor_of(reached)
            if own_floor is not None and floor is not None and floor > own_floor:
                found.append(f"{where} imports {reached}, a floor above ({floor} > {own_floor})")
            mine = policy_package(module)
            shared = tuple(f"{WORKER}.{p}" for p in POLICY_SHARED)
            outside = reached.startswith(f"{WORKER}.policies") and policy_package(reached) != mine
            if mine and outside and not reached.startswith(shared):
                found.append(f"{where} imports {reached}: a policy package imports no other")
            names = [*reached.split(".")[2:], *([imp.name] if imp.name else [])]
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and reached.startswith("gearshift."):
                theirs = package_of(reached, packages)
                if theirs != package_of(module, packages):
                    found.append(f"{where} imports {private[0]}, private to {theirs}")
    return list(dict.fromkeys(found))  # one line per breach, not per name imported


def product_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for folder in ("worker", "operator"):
        for path in (ROOT / folder).rglob("*.py"):
            sources[module_name(path)] = (path.read_text(), path.name == "__init__.py")
    return sources


def test_worker_and_operator_keep_their_floors_and_privates() -> None:
    found = violations(product_sources())
    assert not found, "\n".join(found)


def test_the_checker_sees_imports_wherever_they_are_written() -> None:
    """Each kind of breach, hidden where a module-level scan would miss it, is reported."""
    engine = f"{WORKER}.engine.thing"
    sources = {
        engine: (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from gearshift.worker.policies.base import Policy\n"
            "def f():\n"
            "    from gearshift.worker.server import app\n"
            "    import gearshift.operator.cli\n"
            "    from gearshift.worker.launch.leader import _check\n",
            False,
        ),
        f"{WORKER}.policies.alpha.policy": (
            "from gearshift.worker.policies.beta import policy\n"
            "from gearshift.worker.policies.registry import make_policy\n"
            "from gearshift.worker.policies.base import Policy\n"
            "from . import _helpers\n",
            False,
        ),
        f"{WORKER}.policies.alpha": ("", True),
        f"{WORKER}.policies.alpha._helpers": ("", False),
        f"{WORKER}.newpackage.mod": ("", False),
    }
    found = "\n".join(violations(sources))
    for expected in (
        "thing:3 imports gearshift.worker.policies.base, a floor above",
        "thing:5 imports gearshift.worker.server, a floor above",
        "thing:6 imports gearshift.operator.cli: worker/ never imports operator/",
        "thing:7 imports _check, private to gearshift.worker.launch",
        "policy:1 imports gearshift.worker.policies.beta: a policy package imports no",
        "policy:2 imports gearshift.worker.policies.registry: a policy package imports no",
        "newpackage.mod: on no floor",
    ):
        assert expected in found, (expected, found)
    # Nothing else: its own package's private module and the shared base are fine.
    assert len(violations(sources)) == 8, found  # line 7 breaks two rules


def test_architecture_page_draws_the_floors_the_test_enforces() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = page.split("Floors, bottom up:", 1)[1].split("\n\n", 1)[0]
    for prefixes in FLOORS:
        for prefix in prefixes:
            path = prefix.replace(".", "/")
            assert f"`{path}" in drawn, f"docs/architecture.md's floors do not name {path}"


def test_step_contract_table_lists_every_method_of_policy() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("## The step contract", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\w+)", table))
    public = {
        name
        for name, value in vars(Policy).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    missing = sorted(public - listed)
    assert not missing, f"add these Policy methods to docs/architecture.md's table: {missing}"
