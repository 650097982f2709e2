"""CUDA graphs, host syncs and fused kernels on one GPU (marked gpu: skipped without one).

Greedy tokens with decode graphs equal the same engine's with ``enforce_eager`` for static, Shift
(both gears, one rank: base and shift gear are separate weight copies over one KV cache) and
Seesaw (one rank: the decode gear's weights leave the device at every re-shard and come back to
the addresses its graphs hold). Ranks sharing one GPU run gloo, whose collectives cannot be
captured: multi-rank graphs (NCCL, a GPU per rank) are not run here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = {
    "skip_tokenizer_init": True,
    "device": "cuda",
    "block_size": 16,
    "max_num_batched_tokens": 64,
    "gpu_memory_utilization": 0.3,
    "max_cudagraph_capture_size": 8,
}


def _schedule() -> dict[int, list]:
    g = torch.Generator().manual_seed(5)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 128, (n,), generator=g).tolist()

    return {
        0: [("a", prompt(5), GREEDY), ("b", prompt(17), GREEDY)],
        3: [(f"c{i}", prompt(3 + i), GREEDY) for i in range(8)],  # 10 decodes: past 8, eager
    }


def _graphs(engine):  # type: ignore[no-untyped-def]
    inner = engine.executor.inner
    return getattr(inner, "runner", inner).graphs


def _same(rows, want) -> None:  # type: ignore[no-untyped-def]
    assert rows.keys() == want.keys()
    for rid, entries in rows.items():
        assert [c for c, _ in entries] == [c for c, _ in want[rid]], rid
        for (_, got), (_, ref) in zip(entries, want[rid], strict=True):
            torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_static_graphs_give_the_eager_tokens(tiny_checkpoint, engine_factory, backend):
    folder = tiny_checkpoint("llama2-bias")
    eager = run_recording(
        engine_factory(folder, attention_backend=backend, enforce_eager=True, **ENGINE),
        _schedule(),
    )
    engine = engine_factory(folder, attention_backend=backend, **ENGINE)
    _same(run_recording(engine, _schedule()), eager)
    graphs = _graphs(engine)
    assert graphs is not None and sum(graphs.replays.values()) > 0
    assert graphs.eager_decodes > 0  # the 10-sequence steps ran eagerly


def test_shift_graphs_of_both_gears_give_the_eager_tokens(tiny_checkpoint, group_factory):
    folder = tiny_checkpoint("llama2-bias")
    shift = {"shift": {"sp": 1, "tp": 1, "threshold": 4}}
    eager = run_recording(group_factory(folder, shift, enforce_eager=True, **ENGINE), _schedule())
    engine = group_factory(folder, shift, **ENGINE)
    _same(run_recording(engine, _schedule()), eager)
    assert {gear for gear, _ in _graphs(engine).replays} == {0, 1}


def test_seesaw_decode_graphs_survive_reshards(tiny_checkpoint, group_factory, engine_factory):
    from tests.worker.policies.test_seesaw import DEVICE_KV, _model, _prompts, _seesaw
    from tests.worker.policies.test_seesaw import ENGINE as SEESAW

    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = {"tp": 1, "pp": 1}
    kw = {**SEESAW, "device": "cuda", "max_cudagraph_capture_size": 8}
    eager = group_factory(
        folder, _seesaw(one, one), kv_cache_bytes=DEVICE_KV, enforce_eager=True, **kw
    )
    want = [o.token_ids for o in eager.generate(prompts, params)]
    engine = group_factory(folder, _seesaw(one, one), kv_cache_bytes=DEVICE_KV, **kw)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert {gear for gear, _ in _graphs(engine).replays} == {1}
    assert engine.policy.stats()["transitions"] >= 2


def test_a_replayed_decode_step_synchronises_the_host_once(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("llama2-bias")
    engine = engine_factory(folder, attention_backend="torch", record=False, **ENGINE)
    sampled = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
        presence_penalty=0.3, logit_bias={3: 2.0}, max_tokens=12, ignore_eos=True,
    )  # fmt: skip
    engine.add_request("greedy", [1, 2, 3, 4, 5], GREEDY)
    engine.add_request("sampled", [6, 7, 8], sampled)
    engine.add_request("seeded", [9, 10], SamplingParams(temperature=1.0, seed=4, max_tokens=12))
    for _ in range(3):  # prefills, then every request decodes
        engine.step()
    graphs = engine.executor.graphs
    before = sum(graphs.replays.values())
    syncs = []
    for _ in range(5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert sum(graphs.replays.values()) == before + 5
    assert all(n <= 1 for n in syncs), syncs  # the read of the sampled ids, nothing else
    while engine.has_unfinished_requests():
        engine.step()


def test_fused_kernels_at_serving_shapes_match_torch_in_bf16():
    import torch.nn.functional as F

    from gearshift.worker.model.layers import fused_triton
    from gearshift.worker.model.layers.norm import RMSNorm
    from gearshift.worker.model.layers.rotary import rotate_reference

    torch.manual_seed(0)
    bf16, cuda = torch.bfloat16, torch.device("cuda")
    close = {"atol": 0.05, "rtol": 0.02}
    for tokens in (1, 256, 2048):
        norm = RMSNorm(4096, 1e-5, bf16, cuda)
        norm.weight.data.normal_(1.0, 0.1)
        x = torch.randn(tokens, 4096, dtype=bf16, device=cuda)
        res = torch.randn_like(x)
        want = norm.reference(x + res)
        got, _ = fused_triton.add_rms_norm(x.clone(), res, norm.weight, 1e-5)
        torch.testing.assert_close(got, want, **close)
        qk = torch.randn(tokens, 40, 128, dtype=bf16, device=cuda)
        cos, sin = (torch.randn(tokens, 1, 64, dtype=bf16, device=cuda) for _ in range(2))
        torch.testing.assert_close(fused_triton.rotary(qk, cos, sin),
                                   rotate_reference(qk, cos, sin), **close)  # fmt: skip
        gu = torch.randn(tokens, 2 * 14336, dtype=bf16, device=cuda)
        torch.testing.assert_close(fused_triton.silu_and_mul(gu),
                                   F.silu(gu[:, :14336]) * gu[:, 14336:], **close)  # fmt: skip


def test_fused_kernels_are_measured_at_start_and_keep_the_tokens(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("llama2-bias")
    # fp32: the fused kernels round as torch does, so only the norm's summation order differs.
    plain = engine_factory(folder, fused_elementwise="off", **ENGINE)
    fused = engine_factory(folder, fused_elementwise="on", **ENGINE)
    auto = engine_factory(folder, fused_elementwise="auto", dtype="bfloat16", record=False,
                          **ENGINE)  # fmt: skip
    choice = auto.executor.model.fused_choice
    assert choice is not None and {name for name, *_ in choice.timings} == {
        "add_rms_norm",
        "rotary",
        "silu_and_mul",
    }
    want = run_recording(plain, _schedule())
    assert fused.executor.inner.model.model.norm.fused
    _same(run_recording(fused, _schedule()), want)
