"""The engine on one GPU against that GPU's own limits (issue 27, "Measure").

- (a) batch-1 decode step of a Llama-3-8B-shaped random model (bf16) and of the fidelity run's
  0.7 B model, against the HBM roofline: bytes read per step (weights, KV) / the device-to-device
  copy bandwidth measured here;
- (b) decode tokens/s at batch 64 and 256 over 1k-token contexts (8B shape);
- (c) prefill of 2k and 8k tokens against the bf16 matmul throughput measured here (8B shape);
- (d) the fidelity run's 64-request trace (``sim_fidelity.py --device cuda``): TPOT and TTFT
  against the recorded 11.9 ms and 143 ms, and how far the ``H200`` roofline preset is from it;
- the leader's host time per step, by phase; decode graphs vs eager, fused vs unfused elementwise
  kernels, triton vs torch attention (when the checkout has the triton backend), each measured as
  ratios in one run, interleaved, with the spread.

Bars (reported pass/fail, never asserted): (a) >= 80% of the roofline for the 8B shape; (b) the
batch-64 step within 20% of its HBM-bound time; (c) >= 60% of the measured matmul throughput at
8k; (d) TPOT at least 5x lower than recorded. Models are built in memory (random weights, no
checkpoint) and served through the engine's own start-up path (``launch.rank.finish_rank``).

    bash benchmarks/gpu_check.sh                 # on a GPU machine: runs this, JSON + PNG in $OUT
    python benchmarks/gpu_engine.py --out DIR    # the same, alone (a few minutes on an H100)
    python benchmarks/gpu_engine.py --smoke      # a tiny model on the CPU: the script runs (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
RECORDED_TPOT_S, RECORDED_TTFT_S = 0.0119, 0.143  # benchmarks/README.md, "On a GPU" (H200)
MIN_SECTION_S = 20.0  # no section is started with less of the time budget left

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=16384, rms_norm_eps=1e-5),
    # sim_fidelity.py's random_llama(hidden=2048, layers=8): transformers' LlamaConfig defaults.
    "fidelity-0.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, vocab_size=49152,
                          max_position_embeddings=2048, rms_norm_eps=1e-6),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6),
    "smoke-small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                        max_position_embeddings=512, rms_norm_eps=1e-6),
}  # fmt: skip


class Sizes:
    """What one run measures: full sizes on a GPU, tiny ones for ``--smoke``."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.big = "smoke" if smoke else "llama3-8b"
        self.small = "smoke-small" if smoke else "fidelity-0.7b"
        self.context = 16 if smoke else 1024
        self.batches = (2, 4) if smoke else (64, 256)
        self.prefills = (32, 64) if smoke else (2048, 8192)
        self.steps = 4 if smoke else 24
        self.rounds = 2 if smoke else 3
        self.max_model_len = 128 if smoke else 9216
        self.batched_tokens = 64 if smoke else 8192


# ---- the GPU's own limits --------------------------------------------------------------------


def _timed(fn: Any, reps: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes/s of a device-to-device copy, read and write both counted (best of three)."""
    n = (64 << 20) if smoke else (2 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = min(_timed(lambda: b.copy_(a), 10, device) for _ in range(3))
    return 2 * n / best


def matmul_flops(device: torch.device, smoke: bool) -> float:
    """FLOP/s of a square bf16 matmul (fp32 on the CPU smoke run), best of three."""
    n = 256 if smoke else 8192
    dtype = torch.float32 if smoke else torch.bfloat16
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = min(_timed(lambda: a @ b, 10, device) for _ in range(3))
    return 2 * n**3 / best


# ---- models and engines ----------------------------------------------------------------------


def build_model(name: str, dtype: torch.dtype, device: torch.device, max_len: int) -> Any:
    """(ModelSpec, model): a random model of shape ``name`` on ``device``, no checkpoint."""
    from gearshift.worker.comm import CommGroup
    from gearshift.worker.engine.loading import ModelSpec
    from gearshift.worker.model.config import ModelConfig
    from gearshift.worker.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dict({"model_type": "llama", **SHAPES[name]})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_len, CommGroup.single(), dtype, device)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval()
    return ModelSpec(Path(name), cfg, dtype, max_len), model


def build_engine(spec: Any, model: Any, **knobs: Any) -> Any:
    """A one-rank static engine over ``model``, through the engine's own rank start-up."""
    from gearshift.worker.attention.select import make_attention
    from gearshift.worker.comm import CommGroup
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.engine.model_runner import Gear
    from gearshift.worker.launch.leader import one_rank_engine
    from gearshift.worker.launch.rank import finish_rank
    from gearshift.worker.policies.base import RankModel
    from gearshift.worker.policies.registry import make_policy

    fixed = {"skip_tokenizer_init": True, "enable_prefix_caching": False}
    config = EngineConfig(
        model=str(spec.path), **{"max_model_len": spec.max_model_len, **fixed, **knobs}
    )
    device = torch.device(config.device)
    gear = Gear("static", model, make_attention(config, spec.config.head_dim), CommGroup.single())
    held = RankModel(gears=[gear], kv_layers=spec.config.num_layers, kv_heads=model.num_kv_heads)
    policy = make_policy(None)
    return one_rank_engine(config, policy, finish_rank(config, policy, held, spec, device, 0))


def release(engine: Any) -> None:
    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads of the weights: all but the embedding table (a few rows)."""
    embed = model.model.embed_tokens.weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    tied = model.lm_head is not None and model.lm_head.weight is embed
    return total - (0 if tied else embed.numel() * embed.element_size())


def kv_bytes_per_token(spec: Any) -> int:
    cfg = spec.config
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def matmul_params(spec: Any) -> int:
    """Weights every prefill token multiplies (the decoder's linear layers)."""
    c = spec.config
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_layer += c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer


# ---- what the engine does --------------------------------------------------------------------


def decode_run(engine: Any, batch: int, context: int, steps: int, vocab: int) -> dict[str, Any]:
    """``batch`` sequences over ``context``-token prompts: the time of ``steps`` decode steps."""
    from gearshift.worker.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # Sequences that finished prefill decode in mixed steps until the last one has: plenty of
    # tokens, and every sequence is aborted after the measured steps.
    room = engine.max_model_len - context - 1
    params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    rids = [f"d{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, torch.randint(1, vocab, (context,), generator=g).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every sequence has its first token
        started.update(o.request_id for o in engine.step())
    before = dict(engine.phases.seconds), engine.phases.steps
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == batch, "every sequence decodes in every measured step"
    phases = {k: (v - before[0].get(k, 0.0)) / steps for k, v in engine.phases.seconds.items()}
    for rid in rids:
        engine.abort_request(rid)
    median = statistics.median(times)
    return {
        "batch": batch,
        "context": context,
        "step_s": median,
        "step_s_spread": [min(times), max(times)],
        "tokens_per_s": batch / median,
        "host_phases_s": phases,
    }


def prefill_run(engine: Any, tokens: int, vocab: int, rounds: int) -> dict[str, Any]:
    """The step that prefills one ``tokens``-token prompt (one step: the budget holds it)."""
    from gearshift.worker.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(rounds + 1):
        g = torch.Generator().manual_seed(r)
        prompt = torch.randint(1, vocab, (tokens,), generator=g).tolist()
        engine.add_request(f"p{tokens}-{r}", prompt, params)
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t)
    return {"tokens": tokens, "step_s": statistics.median(times[1:]), "spread": times[1:]}


def fidelity(out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """(d): sim_fidelity.py's 64-request GPU trace, with this checkout's engine."""
    json_out = out_dir / "sim_fidelity_h200_engine.json"
    cmd = [
        sys.executable,
        str(HERE / "sim_fidelity.py"),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--hidden",
        "2048",
        "--layers",
        "8",
        "--requests",
        "64",
        "--roofline",
        "H200",
        "--out",
        str(json_out),
    ]
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError) as exc:
        return {"skipped": f"sim_fidelity.py did not finish: {exc}"}
    rows = {r["figure"]: r for r in json.loads(json_out.read_text())["rows"]}
    tpot, ttft = rows["tpot_mean_s"], rows["ttft_mean_s"]
    return {
        "command": " ".join(cmd[1:]),
        "tpot_s": tpot["measured"],
        "ttft_s": ttft["measured"],
        "tpot_lower_than_recorded_x": RECORDED_TPOT_S / tpot["measured"],
        "ttft_lower_than_recorded_x": RECORDED_TTFT_S / ttft["measured"],
        # The H200 preset's prediction over what this engine measured (1.0: the preset is right).
        "roofline_over_measured": {
            k: r.get("roofline", 0.0) / r["measured"] for k, r in rows.items()
        },
    }


# ---- the run ---------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(
                smi, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except OSError:
            env["driver"] = None
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _bar(value: float, ok: bool, smoke: bool) -> dict[str, Any]:
    verdict = "unmeasured (smoke run)" if smoke else ("pass" if ok else "fail")
    return {"value": value, "result": verdict}


class Report:
    """The figures, section by section; a failed section is recorded and the others go on."""

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.data: dict[str, Any] = {
            "command": " ".join(sys.argv),
            "environment": environment(device),
        }
        self.bars: dict[str, Any] = {}
        self.errors: list[str] = []
        self.deadline = time.monotonic() + budget_s

    def left(self, cap: float) -> float:
        """Seconds left of the budget, at most ``cap``."""
        return max(0.0, min(cap, self.deadline - time.monotonic()))

    def section(self, name: str, fn: Any) -> Any:
        if self.left(float("inf")) < MIN_SECTION_S:
            self.data[name] = {"skipped": "the run's time budget (--budget-s) was spent"}
            return self.data[name]
        try:
            self.data[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failed section leaves the others' figures
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            self.data[name] = {"error": self.errors[-1]}
            print(self.errors[-1], file=sys.stderr)
        return self.data[name]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = Sizes(args.smoke)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    knobs: dict[str, Any] = {
        "device": device.type,
        "dtype": "float32" if args.smoke else "bfloat16",
        "attention_backend": args.attention_backend,
        "max_num_batched_tokens": sizes.batched_tokens,
        "graphs_on_cpu": args.smoke,
        # Decode engines hold 1k-token contexts: their graphs' tables need no more.
        "max_model_len": 64 if args.smoke else 2048,
    }
    gib = (1 << 20) if args.smoke else (1 << 30)  # the KV budgets below are MiB on the CPU
    report = Report(device, args.budget_s)
    bw = copy_bandwidth(device, args.smoke)
    flops = matmul_flops(device, args.smoke)
    report.data["device_limits"] = {"copy_bandwidth_bytes_s": bw, "matmul_flops": flops}
    later: list[tuple[str, Any]] = []
    for role in ("big", "small"):
        name = getattr(sizes, role)
        if report.left(float("inf")) < MIN_SECTION_S:
            report.data[f"a_batch1_{name}"] = {"skipped": "the time budget (--budget-s) was spent"}
            break
        spec, model = build_model(name, dtype, device, sizes.max_model_len)
        ctx = Measure(spec, model, sizes, knobs, bw, flops, gib)
        a = report.section(f"a_batch1_{name}", ctx.batch1)
        comparisons = [
            (f"graphs_vs_eager_{name}", ctx.graphs_vs_eager),
            (f"fused_vs_unfused_{name}", ctx.fused_vs_unfused),
            (f"triton_vs_torch_{name}", ctx.triton_vs_torch),
        ]
        if role == "small":
            later = comparisons  # after (d): the 0.7 B model's ratios matter least
            break
        if "of_roofline" in a:
            ok = a["of_roofline"] >= 0.8
            report.bars["a_8b_of_roofline>=0.8"] = _bar(a["of_roofline"], ok, args.smoke)
        b = report.section("b_decode_batched", ctx.batched)
        if isinstance(b, list):
            over = b[0]["over_hbm_bound"]
            report.bars["b_batch64_within_20%"] = _bar(over, over <= 1.2, args.smoke)
        c = report.section("c_prefill", ctx.prefill)
        if isinstance(c, list):
            top = c[-1]["of_matmul_throughput"]
            report.bars["c_8k_of_matmul>=0.6"] = _bar(top, top >= 0.6, args.smoke)
        for section, fn in comparisons:
            report.section(section, fn)
        del model, ctx, comparisons
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda" and not args.skip_fidelity:
        d = report.section("d_fidelity_trace", lambda: fidelity(args.out, report.left(150.0)))
        if "tpot_lower_than_recorded_x" in d:
            x = d["tpot_lower_than_recorded_x"]
            report.bars["d_tpot_5x_lower_than_recorded"] = _bar(x, x >= 5.0, False)
    else:
        why = "needs CUDA" if device.type != "cuda" else "--skip-fidelity"
        report.data["d_fidelity_trace"] = {"skipped": why}
    for section, fn in later:
        report.section(section, fn)
    return {**report.data, "bars": report.bars, "errors": report.errors}


class Measure:
    """The sections of one model: each builds the engines it needs and releases them."""

    def __init__(
        self,
        spec: Any,
        model: Any,
        sizes: Sizes,
        knobs: dict[str, Any],
        bw: float,
        flops: float,
        gib: int,
    ) -> None:
        self.spec, self.model, self.sizes, self.knobs = spec, model, sizes, knobs
        self.bw, self.flops, self.gib = bw, flops, gib
        self.weights = weight_bytes(model)
        self.kv_token = kv_bytes_per_token(spec)
        self.vocab = spec.config.vocab_size
        self.device = torch.device(knobs["device"])

    def engine(self, **over: Any) -> Any:
        return build_engine(self.spec, self.model, **{**self.knobs, **over})

    def decode(self, engine: Any, batch: int) -> dict[str, Any]:
        s = self.sizes
        return decode_run(engine, batch, s.context, s.steps, self.vocab)

    def batch1(self) -> dict[str, Any]:
        engine = self.engine(max_num_seqs=8, kv_cache_bytes=4 * self.gib)
        try:
            got = self.decode(engine, 1)
        finally:
            release(engine)
        got["roofline_step_s"] = (self.weights + self.kv_token * self.sizes.context) / self.bw
        got["of_roofline"] = got["roofline_step_s"] / got["step_s"]
        return got

    def batched(self) -> list[dict[str, Any]]:
        s = self.sizes
        engine = self.engine(max_num_seqs=max(s.batches), kv_cache_bytes=40 * self.gib)
        try:
            rows = [self.decode(engine, b) for b in s.batches]
        finally:
            release(engine)
        for r in rows:
            r["hbm_bound_step_s"] = (
                self.weights + self.kv_token * s.context * r["batch"]
            ) / self.bw
            r["over_hbm_bound"] = r["step_s"] / r["hbm_bound_step_s"]
        return rows

    def prefill(self) -> list[dict[str, Any]]:
        s = self.sizes
        engine = self.engine(
            max_num_seqs=4, kv_cache_bytes=4 * self.gib, max_model_len=s.max_model_len
        )
        try:
            rows = [prefill_run(engine, n, self.vocab, s.rounds) for n in s.prefills]
        finally:
            release(engine)
        c = self.spec.config
        for r in rows:
            n = r["tokens"]
            attention = 2 * c.num_layers * c.num_heads * c.head_dim * n * n  # causal QK^T and PV
            r["flops"] = 2 * matmul_params(self.spec) * n + attention
            r["of_matmul_throughput"] = r["flops"] / r["step_s"] / self.flops
        return rows

    def compare(self, name: str, variants: dict[str, dict[str, Any]], batch: int) -> Any:
        """Decode steps of each variant's engine, interleaved over rounds: medians and a ratio."""
        over = {"max_num_seqs": max(batch, 8), "kv_cache_bytes": 12 * self.gib}
        engines = {k: self.engine(**{**over, **v}) for k, v in variants.items()}
        times: dict[str, list[float]] = {k: [] for k in variants}
        phases: dict[str, dict[str, float]] = {}
        try:
            for _ in range(self.sizes.rounds):
                for k, engine in engines.items():
                    run_ = self.decode(engine, batch)
                    times[k].append(run_["step_s"])
                    phases[k] = run_["host_phases_s"]
        finally:
            for engine in engines.values():
                release(engine)
        first, second = list(variants)
        return {
            "comparison": name,
            "batch": batch,
            "step_s": times,
            "host_phases_s": phases,
            "ratio": statistics.median(times[second]) / statistics.median(times[first]),
            "ratio_is": f"{second} step time / {first} step time (median of rounds)",
        }

    def graphs_vs_eager(self) -> list[Any]:
        variants = {"graphs": {}, "eager": {"enforce_eager": True}}
        return [self.compare("graphs_vs_eager", variants, b) for b in (1, self.sizes.batches[0])]

    def fused_vs_unfused(self) -> Any:
        if self.device.type != "cuda":
            return {"skipped": "the fused kernels run on CUDA only (the CPU has C++ kernels)"}
        variants = {"fused": {"fused_elementwise": "on"}, "unfused": {"fused_elementwise": "off"}}
        return self.compare("fused_vs_unfused", variants, 1)

    def triton_vs_torch(self) -> Any:
        from gearshift.worker.config import ATTENTION_BACKENDS

        if "triton" not in ATTENTION_BACKENDS:
            have = ", ".join(ATTENTION_BACKENDS)
            return {"skipped": f"no triton attention backend in this checkout ({have})"}
        if self.device.type != "cuda":
            return {"skipped": "triton off CUDA runs interpreted: not a timing"}
        variants = {
            "torch": {"attention_backend": "torch"},
            "triton": {"attention_backend": "triton"},
        }
        return self.compare("triton_vs_torch", variants, self.sizes.batches[0])


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    a = [
        (k[len("a_batch1_") :], v)
        for k, v in report.items()
        if k.startswith("a_batch1_") and "step_s" in v
    ]
    axes[0].bar(
        [f"{n}\nengine" for n, _ in a] + [f"{n}\nroofline" for n, _ in a],
        [v["step_s"] * 1e3 for _, v in a] + [v["roofline_step_s"] * 1e3 for _, v in a],
    )
    axes[0].set_title("(a) batch-1 decode step (ms)")
    b = report.get("b_decode_batched")
    if isinstance(b, list):
        axes[1].bar([f"batch {r['batch']}" for r in b], [r["over_hbm_bound"] for r in b])
        axes[1].axhline(1.2, color="red", linestyle="--")
    axes[1].set_title("(b) step time / HBM-bound time")
    c = report.get("c_prefill")
    if isinstance(c, list):
        axes[2].bar([f"{r['tokens']} tokens" for r in c], [r["of_matmul_throughput"] for r in c])
        axes[2].axhline(0.6, color="red", linestyle="--")
    axes[2].set_title("(c) prefill FLOP/s / matmul FLOP/s")
    env = report["environment"]
    fig.suptitle(f"gpu_engine.py on {env.get('gpu', env.get('cpu'))}, torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=HERE, help="folder for gpu_engine.{json,png}")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (CI)")
    ap.add_argument("--attention-backend", default="auto", help="the engines' attention backend")
    ap.add_argument("--skip-fidelity", action="store_true", help="leave out (d)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=1e9,
        help="start no section after this many seconds (gpu_check.sh gives what it has left)",
    )
    args = ap.parse_args()
    from gearshift.worker.config import ATTENTION_BACKENDS

    if args.attention_backend not in ATTENTION_BACKENDS:
        print(
            f"--attention-backend {args.attention_backend}: this checkout has "
            f"{', '.join(ATTENTION_BACKENDS)}",
            file=sys.stderr,
        )
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    text = json.dumps(report, indent=2, default=float) + "\n"
    folders = {args.out.resolve()} | ({HERE} if not args.smoke else set())
    for folder in folders:
        (folder / "gpu_engine.json").write_text(text)
        plot(report, folder / "gpu_engine.png")
    for name, bar in report["bars"].items():
        print(f"{name}: {bar['value']:.3g} {bar['result']}")
    print(
        json.dumps({k: v for k, v in report.items() if k.startswith(("a_", "d_"))}, default=float)[
            :2000
        ]
    )
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
