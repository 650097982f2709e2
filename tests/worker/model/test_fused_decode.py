"""The fused decode-layer op (kernels.decode_layer) against the Python decoder layer it replaces.

Bit-identical results for the same inputs (same kernels, order and rounding), and the model takes
the fused path exactly when a step is all decodes on one rank through the CPU attention kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from gearshift.worker import kernels
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.model_runner import Done
from gearshift.worker.kernels.cpu_features import host_features
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from gearshift.worker.parallel.ulysses import UlyssesAttention
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording, scattered_block_tables

pytestmark = pytest.mark.usefixtures("cpu_kernels")

HEAD_DIM = 64
CPU = torch.device("cpu")


def make_model(
    heads: int,
    kv_heads: int,
    bias: bool,
    dtype: torch.dtype,
    tp: CommGroup | None = None,
    qk_norm: bool = False,
    layers: int = 2,
    packing: str = "auto",
) -> LlamaForCausalLM:
    """A small random decoder, packed the way the loader leaves it (``auto``: oneDNN for
    bf16/fp16 where this CPU runs it natively; ``plain``: the fallback every CPU runs)."""
    hidden = heads * HEAD_DIM
    cfg = ModelConfig(
        model_type="qwen3" if qk_norm else "llama",
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        qk_norm=qk_norm,
    )
    model = LlamaForCausalLM(cfg, 512, tp or CommGroup.single(), dtype, CPU)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
        model.pack_weights(packing)
    return model.eval()


@dataclass
class DecodeStep:
    """One new token per sequence over random paged history, for every layer of a model."""

    ids: torch.Tensor
    positions: torch.Tensor
    kv: list[LayerKV]
    meta: AttentionMetadata

    def fresh_kv(self) -> list[LayerKV]:
        return [(k.clone(), v.clone()) for k, v in self.kv]


def decode_step(
    lens: list[int], block_size: int, kv_heads: int, layers: int, dtype: torch.dtype, seed: int = 1
) -> DecodeStep:
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 2
    tables = scattered_block_tables(lens, block_size, num_blocks, max(widths), g)
    pos = torch.tensor(lens) - 1
    slots = tables[torch.arange(len(lens)), pos // block_size] * block_size + pos % block_size
    shape = (num_blocks, kv_heads, block_size, HEAD_DIM)
    kv = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]
    meta = AttentionMetadata(
        num_decodes=len(lens),
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        max_decode_seq_len=max(lens),
        prefill_starts=(),
        prefill_query_lens=(),
        prefill_seq_lens=(),
    )
    ids = torch.randint(0, 96, (len(lens),), generator=g)
    return DecodeStep(ids, pos, kv, meta)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts calls of kernels.decode_layer (the model looks it up on the module at call time)."""
    calls = [0]
    real = kernels.decode_layer

    def counting(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(kernels, "decode_layer", counting)
    yield calls


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(6, 2), (8, 2)]  # 3:1 and 4:1
CONTEXTS = {4: [1, 3, 9, 40, 17], 16: [2, 16, 17, 100, 64, 5], 64: [1, 64, 65, 200, 130]}


# Half dtypes run twice: the packing this CPU picks, and the plain path forced (the fallback of
# CPUs without native bf16/fp16 dot products), so every machine covers both paths it can run.
PACKED_DTYPES = [(torch.float32, "auto")] + [
    (dt, packing) for dt in DTYPES[1:] for packing in ("auto", "plain")
]


@pytest.mark.parametrize(("dtype", "packing"), PACKED_DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads"), GQA, ids=["gqa3", "gqa4"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("block_size", sorted(CONTEXTS))
def test_fused_layer_is_bit_identical_to_the_python_layer(
    dtype, packing, heads, kv_heads, bias, block_size
):
    model = make_model(heads, kv_heads, bias, dtype, packing=packing)
    assert model.fused_layers, "every layer should have been prepared for the fused op"
    packed = model.model.layers[0].self_attn.qkv_proj.packed
    native, _ = host_features().onednn_packing(dtype)
    assert (packed is not None) == (packing == "auto" and native)
    step = decode_step(CONTEXTS[block_size], block_size, kv_heads, 1, dtype)
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    rope = model.model.rotary.table(step.positions)
    scale = HEAD_DIM**-0.5
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(len(step.ids), heads * HEAD_DIM, generator=g).to(dtype)
    residual = torch.randn(len(step.ids), heads * HEAD_DIM, generator=g).to(dtype)
    with torch.inference_mode():
        for res in (None, residual):  # the first layer (no residual yet) and a later one
            kv_py, kv_fused = step.fresh_kv()[0], step.fresh_kv()[0]
            want = layer(
                rope,
                hidden.clone(),
                None if res is None else res.clone(),
                kv_py,
                step.meta,
                CpuAttention(scale),
            )
            got = layer.fused_decode(
                rope,
                hidden.clone(),
                None if res is None else res.clone(),
                kv_fused,
                step.meta,
                scale,
            )
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)
            assert torch.equal(kv_fused[0], kv_py[0]) and torch.equal(kv_fused[1], kv_py[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_forward_takes_the_fused_path_for_a_decode_step_with_identical_results(dtype, spy):
    model = make_model(8, 2, True, dtype, layers=3)
    step = decode_step(CONTEXTS[16], 16, 2, 3, dtype)
    core = CpuAttention(HEAD_DIM**-0.5)
    with torch.inference_mode():
        kv = step.fresh_kv()
        fused = model(step.ids, step.positions, kv, step.meta, core)
        assert spy[0] == 3
        layers, model.fused_layers = model.fused_layers, []  # force the Python layers
        ref_kv = step.fresh_kv()
        python = model(step.ids, step.positions, ref_kv, step.meta, core)
        model.fused_layers = layers
    assert spy[0] == 3
    assert torch.equal(fused, python)
    for (k, v), (rk, rv) in zip(kv, ref_kv, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def _run_step(model: LlamaForCausalLM, step: DecodeStep, core: Any) -> None:
    with torch.inference_mode():
        model(step.ids, step.positions, step.fresh_kv(), step.meta, core)


def test_steps_that_are_not_pure_decodes_on_the_cpu_kernel_stay_in_python(spy):
    model = make_model(6, 2, False, torch.bfloat16)
    step = decode_step(CONTEXTS[16], 16, 2, 2, torch.bfloat16)
    scale = HEAD_DIM**-0.5
    slots = step.meta.slot_mapping.clone()
    slots[-1] = -1
    n = len(step.ids)
    padded = replace(step.meta, num_decodes=n - 1, num_padding=1, slot_mapping=slots)
    for meta, core in (
        (step.meta, TorchAttention(scale)),  # the reference core, not the CPU kernel
        (padded, CpuAttention(scale)),  # the last token is not a decode (padding)
    ):
        _run_step(model, DecodeStep(step.ids, step.positions, step.kv, meta), core)
    assert spy[0] == 0
    _run_step(model, step, CpuAttention(scale))
    assert spy[0] == 2


def test_tensor_parallel_sequence_parallel_and_qk_norm_models_are_never_fused():
    scale = HEAD_DIM**-0.5
    step = decode_step(CONTEXTS[16], 16, 2, 2, torch.bfloat16)
    # A TP shard all-reduces inside the layer; Qwen3's q/k norm is not in the op.
    tp_model = make_model(8, 2, False, torch.bfloat16, tp=CommGroup(2, 0, (0, 1)))
    qk_model = make_model(8, 2, False, torch.bfloat16, qk_norm=True)
    hidden = torch.zeros(len(step.ids), 8 * HEAD_DIM, dtype=torch.bfloat16)
    for model in (tp_model, qk_model):
        assert model.fused_layers == []
        assert all(layer.fused is None for layer in model.model.layers)
        assert model._fused_decode_scale(hidden, step.meta, CpuAttention(scale)) is None
    # Ulysses SP wraps the CPU core: the all-to-all sits between the projections and attention.
    model = make_model(8, 2, False, torch.bfloat16)
    single = CommGroup.single()
    ulysses = UlyssesAttention(CpuAttention(scale), single, single, single)
    assert model._fused_decode_scale(hidden, step.meta, ulysses) is None
    assert model._fused_decode_scale(hidden, step.meta, CpuAttention(scale)) == scale


def test_kernels_switched_off_after_loading_route_decodes_through_python(spy, kernels_off):
    model = make_model(6, 2, False, torch.float32)
    assert model.fused_layers
    kernels_off()
    step = decode_step(CONTEXTS[4], 4, 2, 2, torch.float32)
    _run_step(model, step, CpuAttention(HEAD_DIM**-0.5))
    assert spy[0] == 0


@dataclass
class StepCounter:
    """Wraps an executor: per step, whether it was all decodes and how many fused layers ran."""

    inner: Any
    calls: list[int]
    steps: list[tuple[bool, int]]

    def execute(self, plan: Any) -> torch.Tensor | None:
        before = self.calls[0]
        out = self.inner.execute(plan)
        pure = plan.num_decodes == plan.num_tokens
        self.steps.append((pure, self.calls[0] - before))
        return out

    def submit(self, plan: Any) -> Any:
        return Done(self.execute(plan))

    def shutdown(self) -> None:
        self.inner.shutdown()


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama2-bias", "float32"), ("smollm-tied", "bfloat16"), ("qwen3", "float32")],
)
def test_engine_fuses_exactly_the_pure_decode_steps_and_matches_the_python_path(
    family, dtype, spy, tiny_checkpoint, engine_factory, monkeypatch
):
    folder = tiny_checkpoint(family)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 3, 21)]
    requests = {0: [("a", prompts[0], params), ("b", prompts[1], params)]}
    requests[3] = [("c", prompts[2], params)]  # arrives while a and b decode: mixed steps
    kw: dict[str, Any] = {"skip_tokenizer_init": True, "block_size": 4, "dtype": dtype}
    kw["max_num_batched_tokens"] = 16  # c's prompt is chunked: a chunk with cached history
    steps: list[tuple[bool, int]] = []

    def counted(engine: Any) -> Any:
        engine.executor.inner = StepCounter(engine.executor.inner, spy, steps)
        return engine

    fused = run_recording(counted(engine_factory(folder, **kw)), requests)
    layers = 2  # make_hf_checkpoint's default
    expected = 0 if family == "qwen3" else layers
    assert any(pure for pure, _ in steps) and any(not pure for pure, _ in steps)
    assert all(n == (expected if pure else 0) for pure, n in steps), steps
    # The same run with the fused path switched off gives the same logits, bit for bit.
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode_scale", lambda *args: None)
    python = run_recording(engine_factory(folder, **kw), requests)
    assert fused.keys() == python.keys()
    for rid, rows in fused.items():
        assert [c for c, _ in rows] == [c for c, _ in python[rid]], rid
        for (_, a), (_, b) in zip(rows, python[rid], strict=True):
            assert torch.equal(a, b), rid
