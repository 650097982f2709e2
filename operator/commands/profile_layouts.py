"""`gearshift profile --layouts one,tp2,...`: profile the engine once per layout on this machine
with the same step timer as the single-policy profile (sim/profile.py), and write a calibration
profile (sim/calibration.py) naming the device, engine version and dtype it was measured on.
A multi-rank layout's collectives are timed too, inside its running group's worker processes
(worker/parallel/collective_timing.py), at the sizes of ``--collective-sizes``."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gearshift.operator.sim.profile import CollectiveGrid

_LAYOUT = re.compile(r"^(one|(tp|sp|pp|shift)([1-9][0-9]*))$")
_SIZE = re.compile(r"^([1-9][0-9]*)(KiB|MiB)?$")


def layout_policy(name: str) -> dict[str, Any]:
    """The CRD policy object of a layout name (``--layouts``'s syntax)."""
    m = _LAYOUT.match(name)
    if not m:
        raise ValueError(f"--layouts: {name!r} is not one of one, tpN, spN, ppN, shiftN")
    if name == "one":
        return {"static": {}}
    kind, degree = m.group(2), int(m.group(3))
    if degree < 2:
        raise ValueError(f"--layouts: {name!r}: a degree of at least 2 (or 'one')")
    return {"shift": {"sp": degree}} if kind == "shift" else {"static": {kind: degree}}


def collective_grid(args: argparse.Namespace) -> CollectiveGrid:
    """``--collective-sizes`` and ``--collective-repeats`` (defaults: sim/profile.py's)."""
    from gearshift.operator.sim.profile import CollectiveGrid

    grid = CollectiveGrid()
    text = getattr(args, "collective_sizes", None)
    if text is not None:
        sizes = []
        for part in (p.strip() for p in text.split(",")):
            m = _SIZE.match(part)
            if not m:
                raise ValueError(
                    f"--collective-sizes: {part!r} is not a byte count (4096, 64KiB, 16MiB)"
                )
            sizes.append(int(m.group(1)) << {None: 0, "KiB": 10, "MiB": 20}[m.group(2)])
        if len(set(sizes)) < 2:
            raise ValueError(
                "--collective-sizes: at least two distinct sizes (a line has two terms)"
            )
        grid = CollectiveGrid(tuple(sorted(set(sizes))), grid.repeats)
    repeats = getattr(args, "collective_repeats", None)
    if repeats is not None:
        if repeats < 1:
            raise ValueError(f"--collective-repeats: at least 1, got {repeats}")
        grid = CollectiveGrid(grid.sizes, repeats)
    return grid


def time_collectives(engine: Any, grid: CollectiveGrid) -> dict[str, Any]:
    """The layout's collectives timed on ``engine``'s running group: {name: {ranks, points}}
    (empty for one rank)."""
    from gearshift.worker.engine.executor import GroupExecutor
    from gearshift.worker.parallel.collective_timing import CollectiveRequest

    names = engine.policy.collectives()
    if not names or not isinstance(engine.executor, GroupExecutor):
        return {}
    request = CollectiveRequest(tuple(names), grid.sizes, grid.repeats)
    points = engine.executor.time_collectives(request)
    return {n: {"ranks": engine.policy.world_size, "points": p} for n, p in points.items()}


def device_name(device: str) -> tuple[str, str]:
    """(name, kind) of the device the engine runs on: the GPU's, or the CPU model's."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device)), "cuda"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip(), "cpu"
    except OSError:
        pass
    return platform.processor() or platform.machine(), "cpu"


def engine_version() -> str:
    """This engine's version: the installed distribution's, else that of the source checkout it
    runs from (on the path without being installed, as ``benchmarks/gpu_check.sh`` runs it)."""
    try:
        return importlib.metadata.version("gearshift")
    except importlib.metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def run_layouts(args: argparse.Namespace, grid: Any) -> int:
    from gearshift.operator.sim import calibration
    from gearshift.operator.sim.calibration import CalibrationProfile, LayoutProfile, layout_of
    from gearshift.operator.sim.cost_model import CostModelError
    from gearshift.operator.sim.profile import measure
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies import policy_json
    from gearshift.worker.policies.flags import SHORT_FLAGS
    from gearshift.worker.server.settings import engine_config

    given = [f for f in (*SHORT_FLAGS, "policy_config") if getattr(args, f, None) is not None]
    try:
        if given:
            raise ValueError(f"--layouts: give the layouts alone, not with --{given[0]}")
        names = [n.strip() for n in args.layouts.split(",") if n.strip()]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"--layouts: distinct layout names, got {args.layouts!r}")
        policies = {n: layout_policy(n) for n in names}
        if all(_ranks(p) == 1 for p in policies.values()):
            for flag in ("collective_sizes", "collective_repeats"):
                if getattr(args, flag, None) is not None:
                    raise ValueError(
                        f"--{flag.replace('_', '-')}: --layouts {args.layouts} has no multi-rank "
                        "layout (tp2, sp2, pp2, shift2, ...) whose collectives it would time"
                    )
        collective = collective_grid(args)
        config = engine_config(args, enable_prefix_caching=False, skip_tokenizer_init=True)
        api = _api_server(getattr(args, "configmap", None))
        shape, dtype = measured_model(config)
    except (GearshiftError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layouts: dict[str, LayoutProfile] = {}
    for name, policy in policies.items():
        assert layout_of(policy) == name
        try:
            engine = start_engine(config, policy_json.from_dict(policy))
        except (GearshiftError, ValueError) as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 2
        try:
            about = {"model": args.model, "max_num_batched_tokens": config.max_num_batched_tokens}
            cost = measure(engine, grid, args.seed).model(about)
            timed = time_collectives(engine, collective)
            layouts[name] = LayoutProfile(
                policy,
                engine.blocks.num_blocks,
                engine.blocks.block_size,
                cost,
                calibration.collectives_from(timed, f"layouts.{name}.collectives"),
            )
        except (CostModelError, calibration.ProfileError) as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
        finally:
            engine.shutdown()
        print(f"{name}: profiled", file=sys.stderr)
    device, kind = device_name(str(config.device))
    profile = CalibrationProfile(
        device,
        kind,
        max(_ranks(p) for p in policies.values()),
        engine_version(),
        dtype,
        str(args.model),
        shape,
        layouts,
    )
    try:
        profile.save(args.output)  # whole or not at all (checked before profiling: profile.run)
    except OSError as exc:
        print(f"error: --output {args.output}: cannot write: {exc}", file=sys.stderr)
        return 1
    print(profile.describe())
    if api is not None:
        from gearshift.operator.commands.configmap_write import WriteError, write_profile

        try:
            write_profile(api, args.configmap, args.output.read_text())
        except WriteError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"written to ConfigMap {args.configmap}", file=sys.stderr)
    return 0


def _api_server(configmap: str | None) -> Any:
    """Where ``--configmap`` writes, checked before the minutes of profiling (None: no write)."""
    if configmap is None:
        return None
    from gearshift.operator.commands.configmap_write import ApiServer, WriteError

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", configmap):
        raise ValueError(f"--configmap: {configmap!r} is not a ConfigMap name")
    try:
        return ApiServer.in_cluster()
    except WriteError as exc:
        raise ValueError(str(exc)) from None


def _ranks(policy: dict[str, Any]) -> int:
    body = next(iter(policy.values()))
    return max([1, *(int(v) for v in body.values())])


def measured_model(config: Any) -> tuple[dict[str, int], str]:
    """The shape (calibration.SHAPE_KEYS) and dtype of the model ``config`` runs, as the engine
    reads them (its config.json or GGUF metadata; ``--dtype auto`` resolved as the engine
    resolves it): what the profile records it measured, for a plan to compare with its own."""
    import torch

    from gearshift.worker.engine.loading import inspect_model

    spec, source = inspect_model(config, torch.device(str(config.device)))
    source.close()
    c = spec.config
    shape = {
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "head_dim": c.head_dim,
    }
    return shape, str(spec.dtype).removeprefix("torch.")
