"""Shared test helpers for the worker: tiny random checkpoints, logit recording, HF references."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.engine.plan import StepPlan

# Small configs of every family variant the decoder covers (DESIGN.md: model).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3-scaled": {
        "model_type": "llama",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama2-bias": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "smollm-tied": {"model_type": "llama", "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
}


def make_hf_checkpoint(
    folder: Path,
    family: str = "llama2-bias",
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    seed: int = 0,
) -> Path:
    """Save a random Hugging Face model of ``family`` (every weight randomised, biases too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def hf_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """Reference: Hugging Face forward over the whole sequence, fp32, logits of every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@dataclass
class RecordingExecutor:
    """Wraps an executor and keeps each step's plan and logits, in the order steps finish."""

    inner: Any
    records: list[tuple[StepPlan, torch.Tensor]] = field(default_factory=list)
    submitted: list[StepPlan] = field(default_factory=list)

    def submit(self, plan: StepPlan) -> _Recorded:
        self.submitted.append(plan)
        return _Recorded(self, plan, self.inner.submit(plan))

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.submit(plan).result()

    def keepalive(self) -> None:
        self.inner.keepalive()

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass
class _Recorded:
    recorder: RecordingExecutor
    plan: StepPlan
    handle: Any

    def result(self) -> torch.Tensor:
        logits = self.handle.result()
        self.recorder.records.append((self.plan, logits.clone()))
        return logits


def run_recording(
    engine: LLMEngine, add_at: dict[int, list[tuple[str, list[int], Any]]] | None = None
):
    """Step until idle; requests in ``add_at[step]`` are added before that step.

    Returns {request_id: [(context token ids, logits row)]} — one entry per sampled token, the
    context being every token the logits were computed over.
    """
    recorder = engine.executor
    assert isinstance(recorder, RecordingExecutor)
    add_at = dict(add_at or {})
    seen: dict[str, list[int]] = {}
    rows: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    step = 0
    while add_at or engine.has_unfinished_requests():
        for rid, ids, params in add_at.pop(step, []):
            engine.add_request(rid, ids, params)
            seen[rid] = list(ids)
        before = len(recorder.records)
        outs: list[RequestOutput] = engine.step()
        step += 1
        if not outs:
            continue
        assert len(recorder.records) == before + 1
        logits = recorder.records[-1][1]
        for i, out in enumerate(outs):
            rows.setdefault(out.request_id, []).append((list(seen[out.request_id]), logits[i]))
            seen[out.request_id].extend(out.new_token_ids)
    return rows


def scattered_block_tables(
    lens: list[int], block_size: int, num_blocks: int, width: int, generator: torch.Generator
) -> torch.Tensor:
    """[sequences, width] block tables whose blocks are a random permutation of the pool, so a
    kernel that assumed contiguous or ordered blocks would read the wrong KV."""
    widths = [-(-n // block_size) for n in lens]
    assert sum(widths) <= num_blocks and max(widths) <= width
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for b, w in enumerate(widths):
        tables[b, :w] = order[used : used + w]
        used += w
    return tables


def random_model_with_smollm2_tokenizer(
    folder: Path, smollm2: Path, *, num_heads: int = 8, num_kv_heads: int = 2, layers: int = 4
) -> Path:
    """A random Llama (heads that split over TP 2 and 4) that speaks SmolLM2's vocabulary, with
    its tokenizer and chat template saved beside it, so a server can serve it as text."""
    import json

    from gearshift.worker.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2)
    make_hf_checkpoint(
        folder,
        "llama2-bias",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        layers=layers,
        vocab=tok.vocab_size,
    )
    tok.backend.save(str(folder / "tokenizer.json"))
    assert tok.chat_template is not None
    eos = sorted(tok.eos_token_ids)[0]
    config = {
        "chat_template": tok.chat_template.source,
        "eos_token": tok.backend.id_to_token(eos),
        **dict(tok.chat_template.special_tokens),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
