"""Weight sources read exactly the slice asked for, and loading fails clearly when it must."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model.registry import resolve_model_path
from gearshift.worker.model.weights import GGUFSource, SafetensorsSource, open_weight_source


@pytest.fixture(scope="module")
def gguf_source(smollm2_path):
    return GGUFSource(smollm2_path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
    ],
)
@pytest.mark.slow
def test_gguf_narrowed_reads_equal_slices_of_the_full_tensor(gguf_source, name):
    w = gguf_source.get(name)
    full = w.load()
    assert tuple(full.shape) == w.shape
    rows, cols = w.shape
    # Row shards must be head-aligned for q/k (64-row heads); column shards cover block-aligned
    # (32) and unaligned cuts.
    r = w.narrow(0, 64, 128).load()
    torch.testing.assert_close(r, full[64:192], rtol=0, atol=0)
    for start, length in ((32, 64), (5, 40)):
        c = w.narrow(1, start, length).load()
        torch.testing.assert_close(c, full[:, start : start + length], rtol=0, atol=0)
    half = w.chunk(0, 3, 1).chunk(1, 2, 1).load()
    torch.testing.assert_close(half, full[rows // 3 : 2 * rows // 3, cols // 2 :], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.slow
def test_our_gguf_header_reader_agrees_with_the_gguf_package(smollm2_path):
    """GGUFSource walks the header itself (the gguf package's reader takes seconds per open):
    every tensor's name, type, shape and bytes, and the metadata, must be the package's."""
    import gguf
    import numpy as np

    from gearshift.worker.model.weights import read_gguf_tensors

    ours_fields, ours = read_gguf_tensors(smollm2_path)
    reader = gguf.GGUFReader(str(smollm2_path))
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape.tolist() == theirs.shape.tolist(), mine.name
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype
        assert np.array_equal(mine.data, theirs.data), mine.name
    for key in ("general.architecture", "llama.attention.head_count", "llama.block_count"):
        assert ours_fields[key] == reader.fields[key].contents()


def test_gguf_qk_rows_are_in_hugging_face_order(gguf_source, hf_smollm2):
    hf, _ = hf_smollm2
    ours = gguf_source.get("model.layers.5.self_attn.k_proj.weight").load()
    torch.testing.assert_close(
        ours, hf.model.layers[5].self_attn.k_proj.weight.detach(), rtol=0, atol=0
    )


def test_sharded_safetensors_with_index_load_by_slice(tmp_path):
    a, b = torch.randn(6, 4), torch.randn(3, 5)
    save_file({"a": a}, str(tmp_path / "part-1.safetensors"))
    save_file({"b": b}, str(tmp_path / "part-2.safetensors"))
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    src = open_weight_source(tmp_path)
    assert isinstance(src, SafetensorsSource)
    assert sorted(src.names()) == ["a", "b"]
    torch.testing.assert_close(src.get("a").chunk(0, 3, 2).load(), a[4:6])
    torch.testing.assert_close(src.get("b").narrow(1, 1, 3).load(), b[:, 1:4])


def test_missing_shard_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match=r"gone\.safetensors"):
        SafetensorsSource(tmp_path)


def test_unknown_model_names_the_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model_path("no-such-model")
    with pytest.raises(ModelLoadError, match=r"\*\.safetensors"):
        open_weight_source(tmp_path)


def test_checkpoint_missing_a_tensor_is_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    from gearshift.worker.model.config import ModelConfig
    from gearshift.worker.model.loader import build_model

    folder = tiny_checkpoint("llama2-bias")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_hf_folder(folder)
    with pytest.raises(ModelLoadError, match="up_proj"):
        build_model(cfg, SafetensorsSource(tmp_path), 64, torch.float32, torch.device("cpu"))
