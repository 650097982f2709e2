"""`gearshift serve --layout fastest`: the layout that serves fastest on this machine, and why.

Measured on a 2-core CPU (issue 9, `vllm bench serve`, 32 x 128-token prompts, 64 tokens): one
static rank gave 1.21x vLLM's CPU output throughput, shift with SP 3 on three ranks 0.33x: ranks
that share two cores spin against each other. So a small CPU gets one rank. On bigger CPUs the
rule (TP over ranks of at least CORES_PER_RANK cores, as far as the heads divide) is a
heuristic that no run here has measured; the planner replaces it once `policy: auto` exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gearshift.worker.model.registry import resolve_model_path
from gearshift.worker.tokenizer.gguf_metadata import read_gguf_metadata

SMALL_CPU_CORES = 4  # at or below: one rank
CORES_PER_RANK = 4  # fewer cores per rank and the collectives' spinning costs more than TP gains


@dataclass(frozen=True)
class ServeLayout:
    """What `serve` runs: a policy and its sizes, with the reason printed at start."""

    policy: str
    tp: int
    sp: int
    reason: str

    def describe(self) -> str:
        ranks = self.tp * self.sp
        shape = "one rank" if ranks == 1 else f"TP {self.tp} on {ranks} ranks"
        return f"{self.policy}, {shape}: {self.reason}"


def choose_serve_layout(cores: int, num_heads: int, num_kv_heads: int) -> ServeLayout:
    """The fastest CPU layout for `cores` usable cores and a model's attention heads. Pure."""
    if cores <= SMALL_CPU_CORES:
        return ServeLayout(
            "static",
            1,
            1,
            f"{cores} core(s) (<= {SMALL_CPU_CORES}): one rank is fastest on a small CPU "
            "(measured on 2 cores: 1.21x vLLM's throughput, vs 0.33x for shift SP 3 on 3 ranks)",
        )
    most = cores // CORES_PER_RANK
    if most < 2:
        return ServeLayout(
            "static", 1, 1, f"{cores} cores: too few for 2 ranks of {CORES_PER_RANK}: one rank"
        )
    # TP shards whole heads and whole KV heads, so the size must divide both.
    tp = max(r for r in range(1, most + 1) if num_heads % r == 0 and num_kv_heads % r == 0)
    if tp == 1:
        return ServeLayout(
            "static",
            1,
            1,
            f"{cores} cores, but the model's {num_heads} heads / {num_kv_heads} KV heads allow "
            f"no TP size from 2 to {most}: one rank",
        )
    return ServeLayout(
        "static",
        tp,
        1,
        f"{cores} cores: TP {tp} with {cores // tp} cores per rank (the largest size <= "
        f"cores / {CORES_PER_RANK} that divides {num_heads} heads and {num_kv_heads} KV heads; "
        "a heuristic, not measured)",
    )


def model_heads(model: str) -> tuple[int, int]:
    """(attention heads, KV heads) of a model folder, .gguf file or embedded name, torch-free."""
    path = resolve_model_path(model)
    if path.is_file():
        fields = read_gguf_metadata(path)
        arch = str(fields.get("general.architecture", ""))
        heads = int(fields[f"{arch}.attention.head_count"])  # type: ignore[arg-type]
        kv = fields.get(f"{arch}.attention.head_count_kv", heads)
        return heads, int(kv)  # type: ignore[arg-type]
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    heads = int(cfg["num_attention_heads"])
    return heads, int(cfg.get("num_key_value_heads") or heads)
