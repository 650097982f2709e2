"""Seesaw vs the best static layout on PCIe GPUs (Seesaw §6.2, Fig. 10): "The overall average
speedup is 1.36x" (A10 1.45x, L4 1.29x geometric means over models and datasets).

The pinned figure is the simulator's (``seesaw_sim.py``: the engine's Seesaw leader in simulated
time against every static candidate). As a cross-check, an offline-throughput estimate from the
same roofline step costs, phase by phase, for every layout alike:

- A static layout (tp × pp per replica, dp replicas over the 8 GPUs) prefills the whole batch in
  8192-token steps and decodes it in steps of B sequences, B limited by its KV capacity and 256
  sequences; a pipeline keeps pp micro-batches in flight, so a step's trip is shared by pp.
- Seesaw (§4) prefills with one gear and decodes with another over the same GPUs (both
  tp × pp = the replica's GPUs): prefill KV goes to the host tier and comes back for decoding,
  overlapped with compute (§4.3, so a phase takes the longer of compute and its PCIe copies);
  each round of prefill then decode re-shards twice, reloading the replica's weight shard from
  pinned host memory (not overlapped); a round holds as much KV as the host tier (§6.1: 80 GiB
  of CPU memory per GPU).
- Throughput = tokens / time; the speedup is Seesaw's best gear pair over the best static layout.

Hardware per §6.1 / Table 1: L4 (24 GiB, 300 GiB/s, 121 TFLOPS) and A10 (24 GiB, 600 GiB/s,
125 TFLOPS), each GPU on PCIe 4.0 x8 (16 GiB/s) to its peers and the host. Models: LLaMA2-13B
and CodeLLaMA-34B (their published configs) in fp16; datasets: the ShareGPT and
arxiv-summarization length presets' means. Not modelled: vLLM's mixing of prefill and decode in
one step, scheduling gaps, the decode batch Seesaw builds beyond device KV by prefetching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product
from typing import TYPE_CHECKING

from gearshift.operator.sim import hardware, lengths, model_desc
from gearshift.operator.sim.reproduce.common import SETTINGS, Projection, Reproduction, priced
from gearshift.operator.sim.roofline import Layout, LayoutError, RooflineCost, StepShape
from gearshift.operator.sim.trace import TraceRequest

if TYPE_CHECKING:  # the Seesaw leader imports torch; these modules load it only when they run
    from gearshift.operator.sim.candidates import Candidate
    from gearshift.operator.sim.results import SimResult
    from gearshift.operator.sim.seesaw_sim import SeesawHooks

GIB = float(1 << 30)
PCIE4_X8 = hardware.Link(16 * GIB, 5e-6)
HOST_BYTES_PER_GPU = 80 * GIB
REQUESTS = 2000

MODELS = {
    # Hugging Face config.json fields of the published checkpoints.
    "LLaMA2-13B": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                       num_key_value_heads=40, intermediate_size=13824, vocab_size=32000),
    "CodeLLaMA-34B": dict(num_hidden_layers=48, hidden_size=8192, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=22016, vocab_size=32000),
}  # fmt: skip


def gpu(name: str) -> hardware.Hardware:
    flops = {"L4": 121e12, "A10": 125e12}[name]
    device = hardware.Device(
        name, {"fp16": flops, "bf16": flops}, 24 * GIB, {"L4": 300, "A10": 600}[name] * GIB
    )
    base = hardware.preset("8xL4")
    return replace(base, device=device, intra_node=PCIE4_X8, host_device=PCIE4_X8)


@dataclass(frozen=True)
class Work:
    requests: int
    prompt: float
    output: float


def _cost(model: model_desc.ModelDesc, hw: hardware.Hardware, tp: int, pp: int) -> RooflineCost:
    kind, degree = ("tp", tp) if pp == 1 else ("pp", pp)
    if tp > 1 and pp > 1:
        raise LayoutError("the roofline prices tp or pp, not both")
    layout = Layout("one") if degree == 1 else Layout(kind, degree)
    return RooflineCost(model, hardware.with_count(hw, tp * pp), layout)


def _kv_tokens(model: model_desc.ModelDesc, hw: hardware.Hardware, gpus: int) -> float:
    free = hw.device.memory_bytes * SETTINGS.memory_utilization - model.weight_bytes() / gpus
    return max(free, 0.0) * gpus / model.kv_bytes_per_token()


def _step(model, hw, tp: int, pp: int, shape: StepShape) -> float:  # type: ignore[no-untyped-def]
    """One step of ``shape``; a pipeline splits it into pp micro-batches, and in steady state
    every stage works through all of them, so the step takes one micro-batch's whole trip."""
    part = StepShape(shape.tokens / pp, shape.attended / pp, shape.kv_read / pp)  # type: ignore[arg-type]
    return _cost(model, hw, tp, pp).time(part)


def prefill_seconds(model, hw, tp: int, pp: int, w: Work) -> float:  # type: ignore[no-untyped-def]
    step = SETTINGS.max_num_batched_tokens
    shape = StepShape(step, step * w.prompt / 2, step * w.prompt / 2)
    return math.ceil(w.requests * w.prompt / step) * _step(model, hw, tp, pp, shape)


def decode_seconds(model, hw, tp: int, pp: int, w: Work) -> float:  # type: ignore[no-untyped-def]
    context = w.prompt + w.output / 2
    batch = min(SETTINGS.max_num_seqs, int(_kv_tokens(model, hw, tp * pp) // (w.prompt + w.output)))
    if batch < 1:
        return math.inf
    shape = StepShape(batch, batch * context, batch * context)
    steps = math.ceil(w.requests / batch) * w.output
    return steps * _step(model, hw, tp, pp, shape)


def _gears(gpus: int) -> list[tuple[int, int]]:
    return [(t, gpus // t) for t in (1, 2, 4, 8) if gpus % t == 0 and (t == 1 or gpus // t == 1)]


def static_throughput(model, hw, w: Work) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    best = (0.0, "")
    for gpus, (tp, pp) in ((g, gear) for g in (1, 2, 4, 8) for gear in _gears(g)):
        dp = hw.count // gpus
        share = replace(w, requests=math.ceil(w.requests / dp))
        try:
            t = prefill_seconds(model, hw, tp, pp, share) + decode_seconds(model, hw, tp, pp, share)
        except LayoutError:
            continue
        tput = w.requests * (w.prompt + w.output) / t
        best = max(best, (tput, f"tp{tp}pp{pp}dp{dp}"))
    return best


def seesaw_throughput(model, hw, w: Work) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    best = (0.0, "")
    kv_token = model.kv_bytes_per_token()
    for gpus in (2, 4, 8):
        dp = hw.count // gpus
        share = replace(w, requests=math.ceil(w.requests / dp))
        for (ptp, ppp), (dtp, dpp) in product(_gears(gpus), _gears(gpus)):
            try:
                pre = prefill_seconds(model, hw, ptp, ppp, share)
                dec = decode_seconds(model, hw, dtp, dpp, share)
            except LayoutError:
                continue
            kv = share.requests * share.prompt * kv_token
            copy = kv / gpus / hw.host_device.bandwidth  # each GPU moves its share, in parallel
            rounds = math.ceil(kv / (HOST_BYTES_PER_GPU * gpus))
            reshard = 2 * rounds * model.weight_bytes() / gpus / hw.host_device.bandwidth
            t = max(pre, copy) + max(dec, copy) + reshard
            tput = w.requests * (w.prompt + w.output) / t
            best = max(best, (tput, f"P{ptp}x{ppp}->D{dtp}x{dpp} dp{dp}"))
    return best


def speedups() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    datasets = {"sharegpt": lengths.sharegpt(), "arxiv": lengths.arxiv_summarization()}
    for gpu_name, (model_name, cfg), (data, (p, o)) in product(
        ("A10", "L4"), MODELS.items(), datasets.items()
    ):
        hw = gpu(gpu_name)
        model = model_desc.from_config({**cfg, "torch_dtype": "float16"}, model_name)
        w = Work(REQUESTS, p.mean(), o.mean())
        static, s_name = static_throughput(model, hw, w)
        seesaw, z_name = seesaw_throughput(model, hw, w)
        out[f"{gpu_name} {model_name} {data}"] = {
            "static": static, "static_layout": s_name, "seesaw": seesaw, "seesaw_gears": z_name,
            "speedup": seesaw / static,
        }  # fmt: skip
    return out


def simulated_speedups(requests: int = 200) -> dict[str, dict[str, object]]:
    """The same cases through the simulator: the engine's Seesaw leader (seesaw_sim.py) against
    every static candidate, a burst of ``requests`` sent at once."""
    from gearshift.operator.sim.candidates import PlanSettings
    from gearshift.operator.sim.planning import plan_deployment
    from gearshift.operator.sim.traffic import Traffic

    out: dict[str, dict[str, object]] = {}
    settings = PlanSettings(max_model_len=SETTINGS.max_model_len)
    for gpu_name, (model_name, cfg), data in product(
        ("A10", "L4"), MODELS.items(), ("sharegpt", "arxiv")
    ):
        model = model_desc.from_config({**cfg, "torch_dtype": "float16"}, model_name)
        t = Traffic.from_mapping(
            {"rate": 1000, "prompt": {"preset": data}, "requests": requests, "seed": 0}
        )
        report = plan_deployment(
            model, gpu(gpu_name), t, rates=[1000], settings=settings, kinds={"static", "seesaw"}
        )
        tps = {
            r.candidate.name: float(r.at_rate["total_tokens_per_s"])
            for r in report.results
            if r.error is None and r.at_rate
        }
        static = max((v, k) for k, v in tps.items() if not k.startswith("seesaw"))
        seesaw = max((v, k) for k, v in tps.items() if k.startswith("seesaw"))
        out[f"{gpu_name} {model_name} {data}"] = {
            "static": static[0], "static_layout": static[1], "seesaw": seesaw[0],
            "seesaw_gears": seesaw[1], "speedup": seesaw[0] / static[0],
        }  # fmt: skip
    return out


def reproduce() -> Reproduction:
    sim = simulated_speedups()
    sim_ratios = [float(v["speedup"]) for v in sim.values()]  # type: ignore[arg-type]
    sim_mean = math.prod(sim_ratios) ** (1 / len(sim_ratios))
    s = speedups()
    ratios = [float(v["speedup"]) for v in s.values()]  # type: ignore[arg-type]
    mean = math.prod(ratios) ** (1 / len(ratios))
    per = "; ".join(
        f"{k}: {float(v['speedup']):.2f}x ({v['seesaw_gears']} vs {v['static_layout']})"  # type: ignore[arg-type]
        for k, v in s.items()
    )
    sim_per = "; ".join(
        f"{k}: {float(v['speedup']):.2f}x ({v['seesaw_gears']} vs {v['static_layout']})"  # type: ignore[arg-type]
        for k, v in sim.items()
    )
    return Reproduction(
        "Seesaw",
        "offline throughput of Seesaw vs the best static layout on 8 PCIe GPUs (A10, L4)",
        "1.36x average (up to 1.78x)",
        round(sim_mean, 3),
        (1.1, 2.2),
        "x (geometric mean over GPUs, models, datasets)",
        f"Simulated (the engine's Seesaw leader against every static candidate, 200 requests at "
        f"once): {sim_per}. The direction holds in every case; the size overshoots the paper's "
        f"({sim_mean:.2f}x against 1.36x on average, {max(sim_ratios):.2f}x against 1.78x at "
        "most): the simulator overlaps every host copy perfectly, has no "
        "CPU or scheduling overhead in the phase switches, and its static PP re-reads each "
        "stage's weights per decode micro-batch with nothing to hide it. A phase-by-phase "
        f"roofline estimate of the same cases gives {mean:.2f}x ({per}).",
    )


# --- Projection under host-store pressure (issue 29, Measure) -----------------------------------
#
# The same comparison as benchmarks/seesaw.py --pressure, on the paper's PCIe GPUs: an offline
# batch whose prompts' KV is at least ``FILLS`` times the host store of every Seesaw group (the
# paper's 80 GiB per GPU, seesaw_sim.HOST_BYTES_PER_GPU), so "prefill until full, decode until
# drained" (§5.1) runs several rounds; Seesaw's best group size against every static candidate of
# the same 8 GPUs. Workloads: prefill-heavy (arxiv-summarization lengths) and balanced (ShareGPT).

FILLS = 2.0
PRESSURE_WORKLOADS = {"prefill-heavy": "arxiv", "balanced": "sharegpt"}


def pressure_trace(
    model: model_desc.ModelDesc, hw: hardware.Hardware, data: str, seed: int = 0
) -> list[TraceRequest]:
    """Requests (all at t=0) of ``data``'s lengths, drawn until their prompts' KV is ``FILLS``
    times the node's host store; none longer than the model's context."""
    import numpy as np

    from gearshift.operator.sim.seesaw_sim import HOST_BYTES_PER_GPU

    prompts, outputs = lengths.sharegpt() if data == "sharegpt" else lengths.arxiv_summarization()
    need = FILLS * HOST_BYTES_PER_GPU * hw.count / model.kv_bytes_per_token()
    rp, ro = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    trace: list[TraceRequest] = []
    tokens = 0
    while tokens < need:
        p, o = prompts.sample(1, rp)[0], outputs.sample(1, ro)[0]
        p = min(int(p), SETTINGS.max_model_len - int(o))
        trace.append(TraceRequest(0.0, p, int(o)))
        tokens += p
    return trace


def _simulate_seesaw(
    c: Candidate, trace: list[TraceRequest]
) -> tuple[SimResult, list[SeesawHooks]]:
    """``c`` over ``trace``, and the Seesaw leaders that drove it (none for a static one)."""
    import dataclasses

    from gearshift.operator.sim.simulator import simulate

    made: list[SeesawHooks] = []

    def hooks() -> SeesawHooks:
        assert c.hooks is not None
        made.append(c.hooks())  # type: ignore[arg-type]
        return made[-1]

    dep = c.deployment()
    if c.hooks is not None:
        dep = dataclasses.replace(dep, hooks=hooks)
    return simulate(dep, trace), made


def project_pressure(
    gpu_name: str, workload: str, pricing: str, model_name: str = "LLaMA2-13B"
) -> Projection:
    """Seesaw's best group size vs the best static layout of the same 8 ``gpu_name`` GPUs on
    the pressure workload ``workload``, priced ``pricing`` (common.priced)."""
    from gearshift.operator.sim.candidates import enumerate_candidates
    from gearshift.operator.sim.seesaw_sim import HOST_BYTES_PER_GPU

    model = model_desc.from_config({**MODELS[model_name], "torch_dtype": "float16"}, model_name)
    hw = priced(gpu(gpu_name), pricing)
    trace = pressure_trace(model, hw, PRESSURE_WORKLOADS[workload])
    prompt_tokens = sum(r.prompt_tokens for r in trace)
    rows: dict[str, dict[str, object]] = {}
    for c in enumerate_candidates(model, hw, SETTINGS, {"static", "seesaw"}):
        result, leaders = _simulate_seesaw(c, trace)
        row: dict[str, object] = {
            "kind": c.kind,
            "tokens_per_s": result.total_throughput,
            "preemptions": result.preemptions,
            "rejected": len(result.rejected),
        }
        if leaders:
            host_tokens = HOST_BYTES_PER_GPU * c.gpus_per_group / model.kv_bytes_per_token()
            share = prompt_tokens / len(leaders)  # the router spreads the batch over the groups
            row |= {
                "transitions": sum(h.transitions for h in leaders),
                # Each group prefills until its store is full, then decodes until drained:
                # at least ceil(share / store) prefill phases, a switch between each two.
                "min_transitions": len(leaders) * (2 * math.ceil(share / host_tokens) - 1),
                "peak_host_usage": max(
                    (t.host_usage for h in leaders for t in h.leader.transitions), default=0.0
                ),
            }
        rows[c.name] = row
    static = max((r["tokens_per_s"], k) for k, r in rows.items() if r["kind"] == "static")
    seesaw = max((r["tokens_per_s"], k) for k, r in rows.items() if r["kind"] == "seesaw")
    ratio = float(seesaw[0]) / float(static[0])  # type: ignore[arg-type]
    best = rows[str(seesaw[1])]
    return Projection(
        "Seesaw",
        f"Seesaw vs the best static layout, {workload} under host-store pressure "
        f"({model_name}, {len(trace)} requests at once, {prompt_tokens:,} prompt tokens = "
        f"{FILLS:g}x the host store)",
        f"8x{gpu_name} (PCIe 4.0 x8)",
        pricing,
        "x tokens/s, best Seesaw / best static",
        round(ratio, 3),
        "1.36x average, up to 1.78x over vLLM's best static layout (§6.2, Fig. 10)",
        (0.8, 2.5),
        {"best_seesaw": seesaw[1], "best_static": static[1], "candidates": rows},
        f"{seesaw[1]}: {best['transitions']} transitions (at least {best['min_transitions']} "
        f"for these capacities), peak host usage {float(best['peak_host_usage']):.2f}, "  # type: ignore[arg-type]
        f"{best['preemptions']} preemptions; best static {static[1]}.",
    )
