"""Simulator fidelity on this machine: profile the engine, then run one trace through the real
engine and through the simulator, and print predicted vs measured (issue 16, "Prove it").

The default model is a small random Llama (hidden 256, 4 layers, SmolLM2-sized vocabulary, made
in a temporary folder) so a run takes a few minutes on two cores; ``--model smollm2`` profiles the
embedded SmolLM2 (slower). ``--rate`` replays Poisson arrivals in real time; 0 puts every request
at t = 0 (offline). The policy flags are ``gearshift serve``'s (``--tp 2``, ``--sp 2``,
``--pp 2``: the simulator keeps the pipeline's micro-batches in flight as the engine does).

    python benchmarks/sim_fidelity.py                     # → sim_fidelity.json
    python benchmarks/sim_fidelity.py --rate 4 --requests 48
    python benchmarks/sim_fidelity.py --tp 2 --out sim_fidelity_tp2.json

On a GPU (``--device cuda --dtype bfloat16``), ``--roofline H200`` also prices the same trace
from the hardware preset alone (no profile: ``RooflineCost``), which shows how far the preset's
datasheet figures are from what this engine reaches on that device.

    python benchmarks/sim_fidelity.py --device cuda --dtype bfloat16 --hidden 2048 --layers 16 \
        --roofline H200 --out sim_fidelity_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def random_llama(folder: Path, hidden: int, layers: int) -> Path:
    """A random Llama checkpoint (weights drawn from a seeded normal), saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return folder


def engine_config(model: str, num_threads: int, dtype: str = "float32", **extra: Any) -> Any:
    """The engine settings both fidelity scripts run (fp32, no prefix cache, 1024 positions)."""
    from gearshift.worker.config import EngineConfig

    return EngineConfig(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        num_threads=num_threads,
        **extra,
    )


def run_engine(engine, trace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Replay ``trace`` in real time; the measured figures."""
    return measured_figures(trace, *replay(engine, trace))


def replay(engine, trace, cpu_clock: bool = False):  # type: ignore[no-untyped-def]
    """Replay ``trace`` in real time; each request's first and last token times (seconds from
    the start) and token count, by request id ``r{index}``. With ``cpu_clock`` (a one-rank
    engine: its forward runs on this thread), time is this thread's CPU time and an idle engine
    skips ahead to the next arrival: what other processes on a shared machine do to wall time
    is left out, and so is what the engine waits on besides its own work."""
    from gearshift.worker.sampling.params import SamplingParams

    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    pending = list(enumerate(trace))
    clock = time.thread_time if cpu_clock else time.perf_counter
    start = clock()
    skipped = 0.0  # idle time jumped over on the CPU clock
    while pending or engine.has_unfinished_requests():
        now = clock() - start + skipped
        while pending and pending[0][1].arrival_s <= now:
            i, r = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            engine.add_request(
                f"r{i}", [(7 * i + k) % 1000 for k in range(r.prompt_tokens)], params
            )
        if not engine.has_unfinished_requests():
            wait = max(0.0, pending[0][1].arrival_s - now)
            if cpu_clock:
                skipped += wait
            else:
                time.sleep(wait)
            continue
        for out in engine.step():
            t = clock() - start + skipped
            first.setdefault(out.request_id, t)
            last[out.request_id] = t
            count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    return first, last, count


def measured_figures(trace, first, last, count) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Makespan, throughput, mean TTFT and mean TPOT from each request's first and last token
    times (seconds from the start) and token count; requests are ``r{index}`` of ``trace``."""
    ids = [f"r{i}" for i in range(len(trace))]
    ttft = [first[k] - r.arrival_s for k, r in zip(ids, trace, strict=True)]
    tpot = [(last[k] - first[k]) / (count[k] - 1) for k in ids if count[k] > 1]
    span = max(last.values())
    return {
        "makespan_s": span,
        "output_tokens_per_s": sum(count.values()) / span,
        "ttft_mean_s": statistics.mean(ttft),
        "tpot_mean_s": statistics.mean(tpot),
    }


def profile_grid() -> Any:
    """The profile every fidelity script takes of the engines it prices steps by."""
    from gearshift.operator.sim.profile import ProfileGrid

    return ProfileGrid(
        prompt_lens=(16, 64, 160, 320, 500),
        prefill_batches=(1, 3, 8),
        decode_batches=(1, 2, 3, 4, 8, 16, 32),
        contexts=(32, 256, 600),
        decode_steps=5,
        repeats=2,
    )


# The trace's lengths, LogNormal.from_median_p90's (median, p90, low, high) in tokens.
PROMPT_LENGTHS = (120, 400, 8, 700)
OUTPUT_LENGTHS = (40, 120, 2, 200)


def traffic_lengths() -> dict[str, Any]:
    """The trace's lengths as a traffic file gives them (``gearshift plan --traffic``)."""
    return {
        side: {"lognormal": dict(zip(("median", "p90", "low", "high"), spec, strict=True))}
        for side, spec in (("prompt", PROMPT_LENGTHS), ("output", OUTPUT_LENGTHS))
    }


def fidelity_trace(requests: int, rate: float, seed: int) -> list[Any]:
    """Lognormal prompts (median 120) and outputs (median 40): Poisson arrivals at ``rate``
    req/s, or every request at t = 0 when ``rate`` is 0 (offline)."""
    from gearshift.operator.sim.arrivals import Arrivals, RateCurve
    from gearshift.operator.sim.lengths import LogNormal
    from gearshift.operator.sim.trace import TraceRequest
    from gearshift.operator.sim.workload import synthesize

    trace = synthesize(
        requests,
        Arrivals(RateCurve.constant(rate or 1.0)),
        LogNormal.from_median_p90(*PROMPT_LENGTHS),
        LogNormal.from_median_p90(*OUTPUT_LENGTHS),
        seed,
    )
    if not rate:
        trace = [TraceRequest(0.0, r.prompt_tokens, r.output_tokens) for r in trace]
    return trace


def decode_batch(n: int, context: int) -> Any:
    """A scheduler batch of ``n`` decode rows, each ``context`` tokens deep: what a profiled
    step cost is asked for a decode step of that shape."""
    from gearshift.worker.engine.scheduler import ScheduledBatch
    from gearshift.worker.engine.sequence import Sequence

    batch = ScheduledBatch()
    for i in range(n):
        seq = Sequence(f"d{i}", [0] * context, params=None, max_tokens=1)  # type: ignore[arg-type]
        seq.num_computed_tokens = context - 1
        batch.decodes.append(seq)
    return batch


def compare(measured: dict[str, float], predicted: dict[str, float]) -> list[dict[str, float]]:
    """Print measured vs simulated per figure; the rows (error = simulated / measured - 1)."""
    rows = []
    print(f"{'figure':22} {'measured':>10} {'simulated':>10} {'error':>8}")
    for key, real in measured.items():
        err = (predicted[key] - real) / real
        rows.append({"figure": key, "measured": real, "simulated": predicted[key], "error": err})
        print(f"{key:22} {real:10.4f} {predicted[key]:10.4f} {err:+8.1%}")
    return rows


def simulated(result) -> dict[str, float]:  # type: ignore[no-untyped-def]
    tpot = [t for r in result.requests if (t := r.tpot) is not None]
    return {
        "makespan_s": result.makespan,
        "output_tokens_per_s": result.output_throughput,
        "ttft_mean_s": statistics.mean(r.ttft for r in result.requests),
        "tpot_mean_s": statistics.mean(tpot),
    }


def cost_about(cost) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return {
        "prefill": vars(cost.prefill),
        "decode": vars(cost.decode),
        "decode_scale": cost.decode_scale,
        **cost.about,
    }


def fidelity_oos() -> Any:
    """The out-of-sample helper: ``benchmarks.fidelity_oos`` imported as a package (tests), or as
    a sibling when a script runs (its folder is then ``sys.path[0]``)."""
    try:
        from benchmarks import fidelity_oos as oos
    except ModuleNotFoundError:
        import fidelity_oos as oos  # type: ignore[no-redef]
    return oos


def add_oos_args(ap: argparse.ArgumentParser) -> None:
    """The out-of-sample mode's flags (``benchmarks/fidelity_oos.py``)."""
    oos = fidelity_oos()
    arrivals, lengths, seeds = oos.ARRIVALS, list(oos.LENGTHS), list(oos.SEEDS)

    ap.add_argument("--oos", action="store_true", help="validate on out-of-sample traces")
    ap.add_argument("--oos-requests", type=int, default=24, help="requests per validation trace")
    ap.add_argument("--oos-rate", type=float, default=4.0, help="Poisson/Gamma req/s")
    ap.add_argument("--oos-seeds", type=int, nargs="+", default=seeds)
    ap.add_argument("--oos-lengths", nargs="+", default=lengths, choices=lengths)
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="profile and replay in this thread's CPU time (one rank): less moved by other load",
    )
    ap.add_argument("--oos-arrivals", nargs="+", default=list(arrivals), choices=arrivals)


def out_of_sample(args: argparse.Namespace, engine, deployment, profile) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Every validation trace through ``engine`` and ``deployment`` (``profile`` taken already),
    also priced as before issue 30 (``fidelity_oos.PricedBeforeIssue30``) for comparison."""
    from dataclasses import replace

    from gearshift.operator.sim.simulator import simulate

    oos = fidelity_oos()
    before = replace(deployment, cost=oos.PricedBeforeIssue30.of(profile))
    return oos.run(
        oos.scenarios(args.oos_lengths, args.oos_arrivals, args.oos_seeds),
        args.oos_requests,
        args.oos_rate,
        lambda trace: oos.engine_records(trace, *replay(engine, trace, args.cpu_clock)),
        lambda trace: oos.sim_records(simulate(deployment, trace)),
        {"before_issue_30": lambda trace: oos.sim_records(simulate(before, trace))},
    )


def _device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def main() -> None:
    from google.protobuf import json_format

    from gearshift.operator.sim import model_desc
    from gearshift.operator.sim.profile import measure
    from gearshift.operator.sim.replica import ReplicaConfig
    from gearshift.operator.sim.simulator import Deployment, simulate
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies.flags import add_policy_args, policy_from_args

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: a random Llama made for the run")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson req/s; 0: offline")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default: sim_fidelity[_oos].json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=256, help="the random Llama's hidden size")
    ap.add_argument("--layers", type=int, default=4, help="the random Llama's layer count")
    ap.add_argument(
        "--roofline", default=None, help="also price the trace from this hardware preset"
    )
    add_oos_args(ap)
    add_policy_args(ap)
    args = ap.parse_args()
    policy = policy_from_args(args)
    if args.out is None:
        args.out = HERE / ("sim_fidelity_oos.json" if args.oos else "sim_fidelity.json")
    if args.cpu_clock and (not args.oos or args.device != "cpu"):
        raise SystemExit("--cpu-clock goes with --oos on the CPU")
    if args.oos and args.roofline:
        raise SystemExit("--roofline prices the in-sample trace: leave it out with --oos")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(random_llama(Path(tmp), hidden=args.hidden, layers=args.layers))
        gpu = {"device": args.device} if args.device != "cpu" else {}
        config = engine_config(model, args.num_threads, args.dtype, **gpu)
        engine = start_engine(config, policy)
        if args.cpu_clock and engine.policy.world_size != 1:
            engine.shutdown()  # other ranks' work is not on this thread's clock
            raise SystemExit("--cpu-clock times one rank: give no multi-rank policy flags")
        t0 = time.perf_counter()
        clock = time.thread_time if args.cpu_clock else time.perf_counter
        profile = measure(engine, profile_grid(), args.seed, clock)
        about = {"model": args.model or "random-llama", "clock": clock.__name__}
        cost = profile.model(about, per_row=True)
        profile_s = time.perf_counter() - t0
        replica = ReplicaConfig.of_engine(engine)
        stages = max(1, args.pp or 1)
        desc = model_desc.load(model)
        # The engine's own policy decides each step's share (a pipeline's micro-batches).
        deployment = Deployment(
            1,
            replica,
            cost,
            engine.policy.step_request,
            micro_batches=engine.policy.micro_batches(),
            stages=stages,
            # The last stage also runs the LM head: most of this small model's work.
            stage_shares=desc.stage_shares(stages) if stages > 1 else (),
        )
        if args.oos:
            report = out_of_sample(args, engine, deployment, profile)
            engine.shutdown()
            report = {
                "command": "python " + " ".join(sys.argv),
                "device": _device_name(args.device),
                "policy": json_format.MessageToDict(policy),
                "profile_s": profile_s,
                "cost_model": cost_about(cost),
                **report,
            }
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            return
        trace = fidelity_trace(args.requests, args.rate, args.seed)
        measured = run_engine(engine, trace)
        t0 = time.perf_counter()
        predicted = simulated(simulate(deployment, trace))
        sim_s = time.perf_counter() - t0
        roofline = None
        if args.roofline:
            from dataclasses import replace

            from gearshift.operator.sim.hardware import load as load_hardware
            from gearshift.operator.sim.roofline import Layout, RooflineCost

            if engine.policy.world_size != 1:
                raise SystemExit("--roofline prices one rank: give no policy flags with it")
            spec_desc = replace(desc, dtype=args.dtype)
            priced = replace(
                deployment,
                cost=RooflineCost(spec_desc, load_hardware(args.roofline), Layout("one")),
            )
            roofline = simulated(simulate(priced, trace))
        engine.shutdown()

    rows = []
    print(f"{'figure':22} {'measured':>10} {'simulated':>10} {'error':>8}", end="")
    print(f" {'roofline':>10} {'error':>8}" if roofline else "")
    for key, real in measured.items():
        err = (predicted[key] - real) / real
        row = {"figure": key, "measured": real, "simulated": predicted[key], "error": err}
        line = f"{key:22} {real:10.4f} {predicted[key]:10.4f} {err:+8.1%}"
        if roofline:
            row["roofline"] = roofline[key]
            row["roofline_error"] = (roofline[key] - real) / real
            line += f" {roofline[key]:10.4f} {row['roofline_error']:+8.1%}"
        rows.append(row)
        print(line)
    print(f"profile {profile_s:.1f} s; simulation {sim_s * 1000:.1f} ms for {len(trace)} requests")
    result = {
        "command": "python " + " ".join(sys.argv),
        "device": _device_name(args.device),
        "policy": json_format.MessageToDict(policy),
        "cost_model": cost_about(cost),
        "rows": rows,
        "simulated_requests_per_wall_s": len(trace) / sim_s,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
