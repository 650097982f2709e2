"""The calibrated plan against the uncalibrated one on this device (issue 30, "Measure": on a GPU,
profile, then plan against the measured engine, and record the error of each).

1. ``gearshift profile --layouts one`` (the command a user runs) profiles the engine on this
   device and writes a calibration profile.
2. The GPU-engine issue's trace (``sim_fidelity.py``'s: lognormal prompts of median 120 and
   outputs of median 40, a random Llama of hidden 2048 and 8 layers on a GPU), written as a
   traffic file at ``--rate``, is replayed through the same engine settings in real time, after a
   warm-up, ``--repeats`` times. The trace is the plan's own (``Traffic.trace``), request for
   request.
3. ``gearshift plan --profile`` (calibrated) and ``gearshift plan --hardware`` (uncalibrated: the
   preset scaled by the efficiencies fitted to the recorded GPU runs, what plan prices from
   without a profile) plan the same traffic at the same rate; each report's one candidate (one
   rank) is read off. Both read the checkpoint's config.json declaring the dtype the engine ran
   (``--dtype``; the checkpoint is saved in float32): plan --profile refuses a profile of
   another dtype than the model's.
4. Per figure (makespan, output tokens/s, TTFT mean, p50 and p99, TPOT p50 and p99): the measured
   mean and spread over the repeats, each plan's figure, and its error against the measured
   mean and against the worst repeat. Printed, and saved as ``calibrated_plan.json`` in ``--out``.

``--hardware`` defaults to the preset of this GPU's name. On the CPU there is none: give one to
run the uncalibrated plan's path anyway (``--smoke`` does, for CI), and its error then prices a
GPU against this CPU, which means nothing; the report says so.

    python benchmarks/calibrated_plan.py --out "$OUT"     # on a GPU (gpu_check.sh runs it)
    python benchmarks/calibrated_plan.py --smoke --out /tmp/cp   # a tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # `benchmarks.*` when run as a script

from benchmarks import fidelity_oos  # noqa: E402
from benchmarks.sim_fidelity import traffic_lengths  # noqa: E402

GEARSHIFT = [sys.executable, "-m", "gearshift.operator.cli"]
# The fidelity runs' figures that the plan's report gives too (it has no mean TPOT), computed
# the same way for the replay (fidelity_oos.figures) as the plan computes its own.
FIGURES = tuple(f for f in fidelity_oos.FIGURES if f != "tpot_mean_s")


def engine_flags(args: argparse.Namespace, model: Path) -> list[str]:
    """The engine settings, as ``gearshift profile``'s flags (the replay parses the same)."""
    return [
        "--model", str(model), "--device", args.device, "--dtype", args.dtype,
        "--max-model-len", "1024", "--max-num-batched-tokens", str(args.batched_tokens),
        "--num-threads", "1",
    ]  # fmt: skip


def start_replay_engine(flags: list[str]) -> Any:
    """An engine with the settings ``gearshift profile`` used (its own parser and config)."""
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies import policy_json
    from gearshift.worker.server.settings import add_engine_args, engine_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    add_engine_args(ap)
    config = engine_config(
        ap.parse_args(flags), enable_prefix_caching=False, skip_tokenizer_init=True
    )
    return start_engine(config, policy_json.from_dict({"static": {}}))


def planned_config(model: Path, dtype: str, folder: Path) -> Path:
    """The config.json both plans read: the checkpoint's (saved in float32), declaring the dtype
    the engine runs it in (``--dtype``), which the profile records and plan --profile requires
    of the model it prices (and the preset prices its bytes by)."""
    cfg = json.loads((model / "config.json").read_text())
    if dtype != "auto":
        cfg["torch_dtype"] = dtype
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def plan(
    model: Path, traffic: Path, rate: float, report: Path, batched: int, *pricing: str
) -> dict[str, Any]:
    """``gearshift plan`` of the one-rank layout at ``rate``: (pricing line, its figures)."""
    cmd = [
        *GEARSHIFT, "plan", "--model", str(model), *pricing, "--traffic", str(traffic),
        "--rates", str(rate), "--policies", "static", "--no-prune", "--no-progress",
        "--no-extras", "-o", str(report), "--max-model-len", "1024",
        "--max-num-batched-tokens", str(batched),
    ]  # fmt: skip
    done = subprocess.run(cmd, check=False, timeout=600, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gearshift plan {' '.join(pricing)} failed:\n{done.stderr[-3000:]}")
    data = json.loads(report.read_text())
    ones = [c for c in data["candidates"] if c["gpus"] == 1 and c["replicas"] == 1]
    if len(ones) != 1:
        names = [c["name"] for c in data["candidates"]]
        raise SystemExit(f"{' '.join(pricing)}: no one-rank candidate among {names}")
    point = ones[0]["points"][0]
    return {
        "command": "gearshift " + " ".join(cmd[3:]),
        "pricing": data["pricing"],
        "candidate": ones[0]["name"],
        "figures": {f: float(point[f]) for f in FIGURES},
    }


def errors(predicted: dict[str, float], runs: list[dict[str, float]]) -> dict[str, Any]:
    """Per figure: the error against the measured mean, and the worst against any one run."""
    out = {}
    for f in FIGURES:
        mean = statistics.mean(r[f] for r in runs)
        each = [fidelity_oos._error(predicted[f], r[f]) for r in runs]
        out[f] = {
            "error": fidelity_oos._error(predicted[f], mean),
            "worst_error": max(each, key=abs),
        }
    return out


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from benchmarks.sim_fidelity import random_llama, replay
    from gearshift.operator.commands.profile_layouts import device_name
    from gearshift.operator.sim.hardware import preset_of_product
    from gearshift.operator.sim.traffic import Traffic

    device, kind = device_name(args.device)
    hardware = args.hardware or (
        f"1x{p}" if kind == "cuda" and (p := preset_of_product(device)) else None
    )
    if hardware is not None:
        from gearshift.operator.sim.hardware import HardwareError, load

        try:
            load(hardware)
        except HardwareError as exc:  # before minutes of profiling, not after
            raise SystemExit(f"--hardware {hardware}: {exc}") from exc
    model = random_llama(folder / "model", hidden=args.hidden, layers=args.layers)
    flags = engine_flags(args, model)
    planned = planned_config(model, args.dtype, folder / "planned")
    profile = folder / "profile.json"
    t0 = time.perf_counter()
    done = subprocess.run(
        [*GEARSHIFT, "profile", *flags, "--layouts", "one", "-o", str(profile),
         *(["--quick"] if args.smoke else [])],
        check=False, timeout=args.profile_timeout_s,
    )  # fmt: skip
    if done.returncode != 0:  # its stderr went to ours
        raise SystemExit(f"gearshift profile failed (exit {done.returncode})")
    profile_s = time.perf_counter() - t0
    traffic = folder / "traffic.json"
    traffic.write_text(
        json.dumps(
            {"rate": args.rate, "requests": args.requests, "seed": args.seed, **traffic_lengths()}
        )
    )
    trace = Traffic.load(traffic).trace(args.rate)
    engine = start_replay_engine(flags)
    try:
        replay(engine, trace[: max(1, len(trace) // 4)])  # warm-up: the trace's first shapes
        runs, tokens = [], []
        for _ in range(args.repeats):
            first, last, count = replay(engine, trace)
            runs.append(
                fidelity_oos.figures(fidelity_oos.engine_records(trace, first, last, count))
            )
            tokens.append(sum(count.values()))
    finally:
        engine.shutdown()
    plans = {
        "calibrated": plan(
            planned, traffic, args.rate, folder / "plan_profile.json", args.batched_tokens,
            "--profile", str(profile),
        ),
    }  # fmt: skip
    if hardware is not None:
        plans["uncalibrated"] = plan(
            planned, traffic, args.rate, folder / "plan_preset.json", args.batched_tokens,
            "--hardware", hardware,
        )  # fmt: skip
    for p in plans.values():
        p["errors"] = errors(p["figures"], runs)
    measured = {
        f: {
            "mean": statistics.mean(r[f] for r in runs),
            "min": min(r[f] for r in runs),
            "max": max(r[f] for r in runs),
        }
        for f in FIGURES
    }
    return {
        "command": "python " + " ".join(sys.argv),
        "device": device,
        "device_kind": kind,
        "hardware": hardware,
        "uncalibrated_meaningful": hardware is not None and kind == "cuda",
        "model": {"hidden": args.hidden, "layers": args.layers, "dtype": args.dtype},
        "traffic": json.loads(traffic.read_text()),
        "profile_s": profile_s,
        "profile": json.loads(profile.read_text()),
        "repeats": args.repeats,
        "trace_output_tokens": sum(r.output_tokens for r in trace),
        "replayed_output_tokens": tokens,  # per replay: what the engine returned
        "measured": measured,
        "plans": plans,
        **({} if hardware is not None else {"uncalibrated": f"no preset for {device}"}),
    }


def show(report: dict[str, Any]) -> None:
    names = list(report["plans"])
    print(f"device: {report['device']}; profile {report['profile_s']:.1f} s; "
          f"{report['repeats']} replays of {report['traffic']['requests']} requests")  # fmt: skip
    for name in names:
        print(f"{name}: {report['plans'][name]['pricing']}")
    if not report["uncalibrated_meaningful"] and "uncalibrated" in report["plans"]:
        print("(the uncalibrated plan prices a GPU preset against this CPU: its error means "
              "nothing)")  # fmt: skip
    heads = "".join(f" {n:>13} {'err':>7}" for n in names)
    print(f"{'figure':20} {'measured':>10} {'spread':>8}{heads}")
    for f in FIGURES:
        m = report["measured"][f]
        spread = (m["max"] - m["min"]) / m["mean"] if m["mean"] else 0.0
        line = f"{f:20} {m['mean']:10.4f} {spread:8.1%}"
        for n in names:
            p = report["plans"][n]
            line += f" {p['figures'][f]:13.4f} {p['errors'][f]['error']:+7.1%}"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=HERE, help="folder for calibrated_plan.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (CI)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --smoke")
    ap.add_argument("--hidden", type=int, default=None, help="default 2048 (smoke: 64)")
    ap.add_argument("--layers", type=int, default=None, help="default 8 (smoke: 2)")
    ap.add_argument("--requests", type=int, default=None, help="default 64 (smoke: 12)")
    ap.add_argument("--rate", type=float, default=None, help="req/s; default 16 (smoke: 50)")
    ap.add_argument("--seed", type=int, default=1, help="the trace's (the profile is its own)")
    ap.add_argument("--repeats", type=int, default=None, help="replays; default 3 (smoke: 1)")
    ap.add_argument("--hardware", default=None, help="the uncalibrated plan's preset (1xH200)")
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--profile-timeout-s", type=float, default=300.0)
    args = ap.parse_args()
    for key, gpu, smoke in (
        ("device", "cuda", "cpu"), ("dtype", "bfloat16", "float32"), ("hidden", 2048, 64),
        ("layers", 8, 2), ("requests", 64, 12), ("rate", 16.0, 50.0), ("repeats", 3, 1),
    ):  # fmt: skip
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else gpu)
    for key in ("repeats", "requests", "hidden", "layers", "batched_tokens"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}: at least 1, got {getattr(args, key)}")
    if args.rate <= 0 or args.profile_timeout_s <= 0:
        ap.error("--rate and --profile-timeout-s: above 0")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = run(args, Path(tmp))
    (args.out / "calibrated_plan.json").write_text(json.dumps(report, indent=2) + "\n")
    show(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
