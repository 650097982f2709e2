"""`gearshift plan`: simulate every legal policy and layout of a model on some hardware under
declared traffic, print a table, recommend one, and write JSON + PNG (issue 16, item 3;
docs/planning.md). Pure simulation: no torch, no devices."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="simulate every policy and layout; recommend one")
    p.add_argument("--model", required=True, help="a HF config.json or the folder holding it")
    p.add_argument(
        "--hardware",
        help="8xH200, 4xL4, ... or a YAML/JSON file (optional with --profile: it must agree)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="a calibration profile (gearshift profile --layouts): price steps from it",
    )
    p.add_argument(
        "--unprofiled",
        choices=("exclude", "roofline"),
        default=None,
        help="with --profile: what becomes of candidates it lacks: exclude them (default), or "
        "price them from the scaled preset's roofline with the profile's measured links",
    )
    # The traffic flags default to None so that one given with --traffic is refused, not
    # ignored; TRAFFIC_DEFAULTS fills those left out without --traffic.
    p.add_argument(
        "--traffic", help="a YAML/JSON traffic file (instead of the five flags below and --rate)"
    )
    p.add_argument("--rate", type=float, help="requests per second")
    p.add_argument(
        "--burstiness", type=float, help="CV of the gaps (default 1: Poisson; 2: bursty)"
    )
    p.add_argument("--prompt-len", help="a preset or a fixed token count (default sharegpt)")
    p.add_argument(
        "--output-len", help="a preset or a fixed token count (default: the prompt preset's)"
    )
    p.add_argument("--requests", type=int, help="requests per simulated point (default 300)")
    p.add_argument("--seed", type=int, help="the traces' seed (default 0)")
    p.add_argument("--goodput", help="SLO, vLLM's syntax in ms: 'ttft:500 tpot:50'")
    p.add_argument("--rates", help="comma-separated rates to simulate (default: a sweep)")
    p.add_argument(
        "--policies", help="comma-separated policy kinds to consider (static,shift,sidp,seesaw)"
    )
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--output", "-o", type=Path, help="write the report as JSON")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the JSON report (every figure with its error band) on stdout, and the "
        "table and notes on stderr",
    )
    p.add_argument("--png", type=Path, help="write p99 TTFT and TPOT vs rate per candidate")
    p.add_argument(
        "--no-extras", action="store_true", help="skip SiDP's B_th and Tetris's rate table"
    )
    p.add_argument("--sidp-context", type=int, help="tokens per sequence for B_th (default 1024)")
    p.add_argument("--tetris-rates", help="request rates of the Tetris table (default: --rates)")
    p.add_argument(
        "--no-prune",
        action="store_true",
        help="simulate every candidate at every rate, even those that cannot change the choice",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


TRAFFIC_DEFAULTS = {"burstiness": 1.0, "prompt_len": "sharegpt", "requests": 300, "seed": 0}
SIDP_CONTEXT = 1024  # --sidp-context's default
PLOT_SUFFIXES = ("png", "svg", "pdf")  # --png's formats (matplotlib's Agg and built-in ones)


def _length(text: str, flag: str) -> dict[str, Any]:
    if text.isdigit():
        return {"fixed": int(text)}
    from gearshift.operator.sim.traffic import PRESETS

    if text not in PRESETS:
        raise ValueError(
            f"{flag}: {text!r} is neither a token count nor one of {', '.join(PRESETS)}"
        )
    return {"preset": text}


def _rates(text: str, flag: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated numbers, got {text!r}") from None
    if any(not 0 < r < math.inf for r in rates):
        raise ValueError(f"{flag}: every rate must be a finite number > 0, got {text!r}")
    return rates


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_given(args: argparse.Namespace) -> None:
    """Refuse what would otherwise be ignored: an empty value (it is not "left out"), a traffic
    flag beside --traffic, an extras flag where the extras are not computed."""
    for name in ("model", "traffic", "hardware", "goodput", "rates", "policies", "tetris_rates",
                 "prompt_len", "output_len"):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            raise ValueError(f"{_flag(name)}: empty; give a value or leave the flag out")
    if args.traffic is not None:
        for name in ("rate", "burstiness", "prompt_len", "output_len", "requests", "seed"):
            if getattr(args, name, None) is not None:
                field = {"prompt_len": "prompt", "output_len": "output"}.get(name, name)
                raise ValueError(
                    f"{_flag(name)}: not with --traffic (the file's {field!r} field sets it); "
                    "give the traffic as --traffic FILE or as flags, not both"
                )
    for name in ("sidp_context", "tetris_rates"):
        if getattr(args, name, None) is None:
            continue
        if args.no_extras:
            raise ValueError(f"{_flag(name)}: not with --no-extras, which skips what it sets")
        if args.profile is not None:
            raise ValueError(
                f"{_flag(name)}: not with --profile: SiDP's B_th and Tetris's rate table are "
                "roofline-priced, so plan skips them with a profile"
            )


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path, before any work (gearshift.operator.outputs.check)."""
    from gearshift.operator import outputs

    if args.output is not None:
        outputs.check(args.output, "--output")
    if args.png is not None:
        outputs.check(args.png, "--png", PLOT_SUFFIXES)
        if args.output is not None and args.output.resolve() == args.png.resolve():
            raise ValueError(f"--png {args.png}: the same file as --output")


def _traffic_from_flags(args: argparse.Namespace) -> Any:
    from gearshift.operator.sim.traffic import Traffic

    if args.rate is None:
        raise ValueError("--rate: required without --traffic")
    given = {k: getattr(args, k) for k in TRAFFIC_DEFAULTS if getattr(args, k) is not None}
    flags = {**TRAFFIC_DEFAULTS, **given}
    for name in ("rate", "burstiness"):
        value = args.rate if name == "rate" else flags[name]
        if not 0 < value < math.inf:
            raise ValueError(f"{_flag(name)}: a finite number > 0, got {value}")
    if flags["requests"] < 1:
        raise ValueError(f"--requests: at least 1, got {flags['requests']}")
    if flags["seed"] < 0:
        raise ValueError(f"--seed: at least 0, got {flags['seed']}")
    data: dict[str, Any] = {
        "rate": args.rate,
        "burstiness": flags["burstiness"],
        "prompt": _length(flags["prompt_len"], "--prompt-len"),
        "requests": flags["requests"],
        "seed": flags["seed"],
    }
    if args.output_len is not None:
        data["output"] = _length(args.output_len, "--output-len")
    return Traffic.from_mapping(data, "traffic (flags)")


def _inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    from gearshift.operator.sim import calibration, hardware, model_desc, pricing
    from gearshift.operator.sim.candidates import PlanSettings
    from gearshift.operator.sim.goodput import Goodput
    from gearshift.operator.sim.traffic import Traffic

    _check_given(args)
    _check_outputs(args)
    model = model_desc.load(args.model)
    hw = hardware.load(args.hardware) if args.hardware is not None else None
    unprofiled = getattr(args, "unprofiled", None)
    if args.profile is None and unprofiled is not None:
        raise ValueError("--unprofiled: only with --profile")
    if args.profile is None and hw is None:
        raise ValueError("--hardware: required without --profile")
    profile = calibration.load(args.profile) if args.profile is not None else None
    if profile is not None:  # its step costs price only the model it measured, in its dtype
        calibration.check_model(
            profile, model, f"--profile {args.profile}", f"--model {args.model}",
            lambda key: f"--model's {'torch_dtype' if key == 'dtype' else key}",
        )  # fmt: skip
    # policy: auto's rule too (pricing.choose)
    priced = pricing.choose(hw, profile, args.hardware, unprofiled or "exclude")
    traffic = Traffic.load(args.traffic) if args.traffic is not None else _traffic_from_flags(args)
    goodput = Goodput.parse(args.goodput) if args.goodput is not None else None
    rates = _rates(args.rates, "--rates") if args.rates is not None else None
    kinds = None
    if args.policies is not None:
        from gearshift.operator.sim.candidates import MODELLED_KINDS

        kinds = {k.strip() for k in args.policies.split(",")}
        if kinds - set(MODELLED_KINDS):
            raise ValueError(
                f"--policies: {sorted(kinds - set(MODELLED_KINDS))} are not policy kinds the "
                f"simulator runs ({', '.join(MODELLED_KINDS)})"
            )
    if args.sidp_context is None:
        args.sidp_context = SIDP_CONTEXT
    if args.sidp_context < 1:
        raise ValueError("--sidp-context: must be >= 1")
    if args.tetris_rates is not None:
        args.tetris_rates = _rates(args.tetris_rates, "--tetris-rates")
    if args.max_model_len < 1 or args.max_num_batched_tokens < 1:
        raise ValueError("--max-model-len / --max-num-batched-tokens: must be >= 1")
    settings = PlanSettings(args.max_model_len, args.max_num_batched_tokens)
    return model, priced, traffic, goodput, rates, kinds, settings


def run(args: argparse.Namespace) -> int:
    from gearshift.operator.sim.planning import plan_deployment
    from gearshift.operator.sim.progress import plan_bar

    try:
        model, priced, traffic, goodput, rates, kinds, settings = _inputs(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hw = priced.hardware
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
    say(f"pricing: {priced.describe}")
    say(priced.links_text())
    bar = plan_bar(desc="simulating", unit="point", file=sys.stderr, disable=args.no_progress)
    try:
        report = plan_deployment(
            model,
            hw,
            traffic,
            goodput,
            rates=rates,
            settings=settings,
            kinds=kinds,
            progress=bar,
            prune=not args.no_prune,
            pricing=priced,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    data = report.to_json()
    data["model"] = model.name
    data["hardware"] = args.hardware or f"{hw.count}x {hw.device.name} (from the profile)"
    failed = None
    if data["recommended"] is None:
        failed, data["reason"] = no_recommendation(data, traffic, settings, args.traffic)
    if priced.excluded:
        say(f"excluded (not in the profile): {', '.join(priced.excluded)}")
    if priced.roofline_priced:
        say(f"priced from the roofline (not in the profile): {', '.join(priced.roofline_priced)}")
    if priced.grid_note():
        say(priced.grid_note())
    say(table(data))
    if failed is None and not args.no_extras and priced.profile is not None:
        say("extras skipped: SiDP's B_th and Tetris's rate table are roofline-priced")
    elif failed is None and not args.no_extras:
        from gearshift.operator.sim import plan_extras

        data["sidp_b_th"] = plan_extras.sidp_thresholds(model, hw, args.sidp_context)
        data["tetris_improvement_rates"] = plan_extras.tetris_table(
            model, hw, traffic, args.tetris_rates or report.rates, plan_extras.TETRIS_REQUESTS
        )
        say(plan_extras.text(data))
    try:
        text = json.dumps(data, indent=2, allow_nan=False)
    except ValueError as exc:  # a non-finite figure: strict JSON has none
        print(f"error: the report holds a figure JSON cannot carry: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(text)
    if failed is not None:
        # No plan: nothing written (-o, --png), the reason on stderr and in --json's report.
        print(f"error: no recommendation: {data['reason']}", file=sys.stderr)
        return failed
    return write_outputs(args, data, text)


def no_recommendation(
    data: dict[str, Any], traffic: Any, settings: Any, traffic_file: str | None
) -> tuple[int, str]:
    """Why no candidate was recommended, and the exit status: 2 when the inputs are at fault
    (every request of the declared traffic is longer than --max-model-len), else 1."""
    from gearshift.operator.sim.simulator import refusal

    trace = traffic.trace()
    too_long = [why for req in trace if (why := refusal(req, settings.max_model_len))]
    if trace and len(too_long) == len(trace):
        lengths = (
            f"the prompt and output lengths of --traffic {traffic_file}"
            if traffic_file is not None
            else "--prompt-len / --output-len"
        )
        return 2, (
            f"every one of the {len(trace)} requests of the declared traffic is longer than "
            f"--max-model-len {settings.max_model_len} (the first: {too_long[0]}), so every "
            f"candidate refuses them all; raise --max-model-len or shorten {lengths}"
        )
    per: list[str] = []
    for c in data["candidates"]:
        at = next((p for p in c["points"] if p["declared"]), None)
        if c["error"]:
            per.append(f"{c['name']}: {c['error']}")
        elif c.get("pruned"):
            per.append(f"{c['name']}: pruned ({c['pruned']})")
        elif at is not None and not at.get("requests"):
            per.append(f"{c['name']}: refused all {at.get('rejected', 0)} requests")
        else:
            per.append(f"{c['name']}: no result at the declared rate")
    return 1, "no candidate served a request of the declared traffic: " + "; ".join(per)


def write_outputs(args: argparse.Namespace, data: dict[str, Any], text: str) -> int:
    """-o and --png, each written whole to a temporary file beside it and renamed into place
    once both are written: a failure leaves neither behind."""
    import contextlib

    from gearshift.operator import outputs

    try:
        with contextlib.ExitStack() as stack:
            if args.output is not None:
                tmp = stack.enter_context(outputs.replacing(args.output))
                tmp.write_text(text + "\n", encoding="utf-8")
            if args.png is not None:
                plot(data, stack.enter_context(outputs.replacing(args.png)))
    except (OSError, ValueError) as exc:
        print(f"error: writing the report: {exc}; nothing was written", file=sys.stderr)
        return 1
    return 0


def table(data: dict[str, Any]) -> str:
    from gearshift.operator.sim.planning import TIE_RULE

    head = (
        f"{'candidate':>12} {'policy':>28} {'KV tok/grp':>10} {'TTFT p50':>9} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>8} {'out tok/s':>10} {'max rate':>8}"
    )
    lines = [
        f"{data['model']} on {data['hardware']}; declared rate {data['declared_rate']:g} "
        f"req/s; SLO: {data['goodput'] or 'none'}",
        head,
    ]
    ties = set(data.get("ties") or [])
    for c in data["candidates"]:
        at = next((p for p in c["points"] if p["declared"]), None)
        mark = "=" if c["name"] in ties else " "  # tied with the recommendation
        if c.get("pruned"):
            lines.append(f"{c['name']:>12} {json.dumps(c['policy']):>28} pruned: {c['pruned']}")
            continue
        if c["error"] or at is None or not at.get("requests"):
            lines.append(
                f"{c['name']:>12} {json.dumps(c['policy']):>28} {c['error'] or 'no result'}"
            )
            continue
        rate = c["max_rate_meeting_slo"]
        top = ">=" if c["max_rate_at_sweep_top"] else ""
        lines.append(
            f"{c['name']:>12} {json.dumps(c['policy']):>28} {c['kv_tokens_per_group']:>10} "
            f"{at['ttft_p50_s']:>9.3f} {at['ttft_p99_s']:>8.3f} {at['tpot_p50_s']:>9.4f} "
            f"{at['tpot_p99_s']:>8.4f} {at['output_tokens_per_s']:>10.0f} "
            f"{'-' if rate is None else f'{top}{rate:g}':>8}{mark}"
            + (f" refused {at['rejected']} of {at['requests'] + at['rejected']}"
               if at.get("rejected") else "")
        )  # fmt: skip
    if "pruned_candidates" in data:
        lines.append(
            f"pruned: {data['pruned_candidates']} of {len(data['candidates'])} candidates "
            f"(their no-queueing lower bounds cannot change the choice); "
            f"{data['simulated_points']} points simulated (--no-prune: every one)"
        )
    if ties:
        lines.append(
            f"tie (=): {', '.join(data['ties'])} are within the simulator's measured error of "
            f"the first ranked ({_band(data)}); the rule: {data.get('tie_rule') or TIE_RULE}"
        )
        if data.get("tie_decision"):
            lines.append(f"tie broken: {data['tie_decision']}")
    if data["recommended"] is None:
        lines.append("recommended: none")
    else:
        lines.append(f"recommended: {data['recommended']} {json.dumps(data['recommended_policy'])}")
    lines.append(f"why: {data['reason']}")
    return "\n".join(lines)


def _band(data: dict[str, Any]) -> str:
    band = data.get("error_band") or {}
    return ", ".join(f"{k} ±{v:.0%}" for k, v in band.items())


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for c in data["candidates"]:
        pts = [p for p in c["points"] if p.get("requests")]
        if not pts:
            continue
        xs = [p["rate"] for p in pts]
        a.plot(xs, [p["ttft_p99_s"] for p in pts], "o-", label=c["name"])
        b.plot(xs, [p["tpot_p99_s"] for p in pts], "o-", label=c["name"])
    for ax, what in ((a, "p99 TTFT (s)"), (b, "p99 TPOT (s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.set_xscale("log")
    b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"gearshift plan: {data['model']} on {data['hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=path.suffix.lower().lstrip(".") or None)
    plt.close(fig)
