"""Our torch dequantisation of GGUF's Q4_0/Q4_1/Q8_0 blocks is bitwise the ``gguf`` package's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gearshift.worker.model import gguf_dequant
from gearshift.worker.model.weights import read_gguf_tensors

Q = gguf.GGMLQuantizationType


def _reference(rows: np.ndarray, qtype: Q) -> torch.Tensor:
    out = gguf.quants.dequantize(np.ascontiguousarray(rows), qtype).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(rows.shape[0], -1)))


def test_every_quantised_tensor_of_the_embedded_file_is_bitwise_the_references(smollm2_path):
    _, tensors = read_gguf_tensors(smollm2_path)
    seen: set[Q] = set()
    for t in tensors:
        if not gguf_dequant.supported(t.tensor_type):
            continue
        seen.add(Q(t.tensor_type))
        rows = np.asarray(t.data)
        got = gguf_dequant.dequantize(rows, t.tensor_type)
        want = _reference(rows, t.tensor_type)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), t.name
    assert seen == {Q.Q4_1, Q.Q8_0}  # the file's two quantised formats both went through here


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_random_blocks_with_extreme_scales_are_bitwise_the_references(qtype):
    rng = np.random.default_rng(int(qtype))
    weights = rng.standard_normal((7, 4 * 32)).astype(np.float32)
    weights[0] *= 6e4  # scales near fp16's largest
    weights[1] *= 1e-6  # subnormal scales
    weights[2] = 0.0  # a zero scale
    raw = gguf.quants.quantize(weights, qtype)
    raw[3, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # an inf scale
    got = gguf_dequant.dequantize(raw, qtype)
    want = _reference(raw, qtype)
    assert got.shape == (7, 128)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    same = torch.isnan(want) | (got.view(torch.int32) == want.view(torch.int32))
    assert bool(same.all())


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_dequant.dequantize(np.zeros((2, 21), np.uint8), Q.Q4_1)
    assert not gguf_dequant.supported(Q.Q6_K)
