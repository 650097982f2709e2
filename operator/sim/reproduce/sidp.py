"""SiDP's KV capacity (SiDP §5, Fig. 5): "SiDP systematically increases the maximum KV token
budget compared to vLLM (~1.7x with TP=2, DP=4)" for Llama-3.1-70B.

Both sides are the simulator's candidates on one 8-GPU node at the shared 0.9 memory
utilisation: vLLM's DP + TP is four TP-2 groups, each holding all the weights; SiDP is one group
of four TP-2 replicas whose ranks hold their TP shard of attention and embeddings, the FFN of the
layers their replica owns and the WaS cache slots (the engine's own formula,
``worker/policies/sidp/ownership.py``). The ratio depends on how much memory is left after the
replicated weights, so the GPU matters. Fig. 5's caption says "on H20", and the paper's Table 1
gives its H20 node 144 GB per GPU (the 141 GB HBM3e H20, not the 96 GB one), so the pinned figure
uses the paper's H20 with the paper's 144 GB. The 96 GB datasheet H20 and the H200 preset are
reported beside it.
"""

from __future__ import annotations

from dataclasses import replace

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.candidates import enumerate_candidates
from gearshift.operator.sim.reproduce.common import FIXTURES, SETTINGS, Reproduction

GB = 1e9


def h20(memory_gb: float = 144) -> hardware.Hardware:
    """NVIDIA H20 on an 8-GPU node; links as the H200 preset's (NVLink 4, as the paper's Table 1).
    Memory: the paper's Table 1 (144 GB per GPU on its H20 node) by default; NVIDIA's datasheet
    also lists a 96 GB H20. Compute and bandwidth (datasheet: BF16 148 TFLOPS dense, 4.0 TB/s)
    do not enter the KV arithmetic."""
    base = hardware.preset("8xH200")
    device = hardware.Device(
        "H20", {"bf16": 148e12, "fp16": 148e12, "fp8": 296e12}, memory_gb * GB, 4.0e12
    )
    return replace(base, device=device)


def ratio(hw: hardware.Hardware) -> tuple[float, int, int]:
    model = model_desc.load(FIXTURES / "llama3_70b_config.json")
    cands = {c.name: c for c in enumerate_candidates(model, hw, SETTINGS)}
    plain = 4 * cands["tp2x4"].kv_tokens
    shared = cands["sidp2x4"].kv_tokens
    return shared / plain, plain, shared


def reproduce() -> Reproduction:
    on_paper_h20, plain, shared = ratio(h20())
    on_h20_96, _, _ = ratio(h20(96))
    on_h200, _, _ = ratio(hardware.preset("8xH200"))
    return Reproduction(
        "SiDP",
        "KV capacity of SiDP vs vLLM DP+TP at TP=2, DP=4 (Llama-3.1-70B)",
        "~1.7x (Fig. 5, on H20)",
        round(on_paper_h20, 3),
        (1.5, 1.9),
        "x (KV tokens, SiDP / vLLM)",
        f"8xH20 with the paper's 144 GB per GPU (Table 1): {shared:,} vs {plain:,} KV tokens. "
        f"The H200 preset (141 GB) gives {on_h200:.2f}x. A 96 GB H20 would give "
        f"{on_h20_96:.2f}x, because vLLM's TP-2 replicas keep only ~16 GB per GPU for KV "
        "there; the paper's H20 is the 144 GB part, so that figure is not the paper's setup.",
    )
