"""bf16 and fp16 engines agree with fp32, with the weight packing this CPU picks and with the
plain F.linear fallback forced (what CPUs without native bf16/fp16 run)."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.kernels.cpu_features import host_features
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

CHATS = ["What is the capital of France?", "Write one word that rhymes with cat."]


# The fp32 reference rows, computed once for the module's four cases.
_FP32: dict[str, list] = {}


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["auto", "plain"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_track_fp32(dtype, packing, smollm2_path, engine_factory):
    native, _ = host_features().onednn_packing(getattr(torch, dtype))
    if packing == "auto" and not native:
        # auto resolves to plain F.linear on this CPU: the `plain` case runs that very path.
        pytest.skip(f"auto packing is plain for {dtype} on this CPU (the plain case covers it)")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows = {}
    for name in ("float32", dtype):
        if name == "float32" and _FP32:
            rows[name] = _FP32
            continue
        engine = engine_factory(smollm2_path, dtype=name, max_model_len=256, weight_packing=packing)
        prompts = {
            f"c{i}": engine.tokenizer.apply_chat_template([{"role": "user", "content": c}])
            for i, c in enumerate(CHATS)
        }
        rows[name] = run_recording(
            engine, {0: [(rid, ids, params) for rid, ids in prompts.items()]}
        )
        if name == "float32":
            _FP32.update(rows[name])
        else:
            linear = engine.executor.inner.model.model.layers[0].mlp.gate_up_proj
            assert linear.weight.dtype == getattr(torch, dtype)
            assert (linear.packed is not None) == (packing == "auto" and native)
    for rid in rows["float32"]:
        ref, got = rows["float32"][rid][0][1], rows[dtype][rid][0][1].float()
        # fp32's choice is bf16's too, up to rounding: bf16 spacing at |logit| ~ 30 is 0.125, and
        # fp32 margins can be smaller than that (ties are then broken by the lower token id).
        assert got[ref.argmax()] >= got.max() - 2 * 2**-8 * got.abs().max()
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=0)
        assert cos > 0.999, float(cos)
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()
