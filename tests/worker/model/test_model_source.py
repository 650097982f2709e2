"""`hf://` sources against a local Hub (tests/worker/model/hub_server.py): downloads, revision
pinning, HF_TOKEN, no second transfer, clear errors, the `gearshift fetch-model` command, and a
downloaded random model that loads with the same weights as its original folder."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model, load_model
from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model import source
from gearshift.worker.model.registry import resolve_model_path
from tests.worker.helpers import make_hf_checkpoint
from tests.worker.model.hub_server import HubServer, Repo

TOKEN = "hf_test_token"


def _tokenizer_json(vocab: int) -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def _files(folder: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["tokenizer.json"] = _tokenizer_json(128)
    files["pytorch_model.bin"] = b"pickled weights that must never be fetched"
    return files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two random checkpoints of one architecture (the repo's old and new commit)."""
    old = make_hf_checkpoint(tmp_path_factory.mktemp("old"), "smollm-tied", seed=1)
    new = make_hf_checkpoint(tmp_path_factory.mktemp("new"), "smollm-tied", seed=2)
    return old, new


@pytest.fixture()
def hub(
    tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[HubServer]:
    old, new = tiny
    with HubServer(token=TOKEN) as server:
        repo = Repo()
        repo.add_commit(_files(old), "v1")
        repo.add_commit(_files(new), "main")
        server.repos["org/tiny"] = repo
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("GEARSHIFT_MODEL_CACHE", str(tmp_path / "cache"))
        yield server


def _weights(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()


def test_a_pinned_revision_downloads_that_commit_and_only_loadable_files(
    hub: HubServer, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = tiny
    repo = hub.repos["org/tiny"]
    got = source.fetch(source.HubSource.parse("hf://org/tiny", "v1"), tmp_path / "v1")
    assert _weights(got) == _weights(old)
    assert not (got / "pytorch_model.bin").exists()
    sha = repo.refs["main"]
    got = source.fetch(source.HubSource.parse(f"hf://org/tiny@{sha}"), tmp_path / "sha")
    assert _weights(got) == _weights(new)
    got = source.fetch(source.HubSource.parse("hf://org/tiny"), tmp_path / "main")
    assert _weights(got) == _weights(new)
    assert (got / "tokenizer.json").is_file() and (got / "config.json").is_file()


def test_a_second_fetch_of_the_same_revision_transfers_nothing(
    hub: HubServer, tmp_path: Path
) -> None:
    src = source.HubSource("org/tiny", "v1")
    source.fetch(src, tmp_path / "m")
    first = len(hub.downloads)
    assert first >= 3  # config, weights, tokenizer
    source.fetch(src, tmp_path / "m")
    assert len(hub.downloads) == first


def test_tokenizer_only_skips_the_weights(hub: HubServer, tmp_path: Path) -> None:
    got = source.fetch(source.HubSource("org/tiny"), tmp_path / "tok", tokenizer_only=True)
    assert (got / "tokenizer.json").is_file()
    assert not list(got.glob("*.safetensors"))


def test_missing_repo_revision_file_or_token_are_clear_errors(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="hf://org/nope: repository not found"):
        source.fetch(source.HubSource("org/nope"), tmp_path / "a")
    with pytest.raises(ModelLoadError, match="revision 'v9' not found"):
        source.fetch(source.HubSource("org/tiny", "v9"), tmp_path / "b")
    hub.repos["org/tiny"].missing.add("config.json")
    with pytest.raises(ModelLoadError, match="a file of the repository is missing"):
        source.fetch(source.HubSource("org/tiny"), tmp_path / "c")
    hub.repos["org/tiny"].missing.clear()
    hub.repos["org/bins"] = Repo()
    hub.repos["org/bins"].add_commit(
        {"config.json": b"{}", "tokenizer.json": b"{}", "pytorch_model.bin": b"x"}, "main"
    )
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        source.fetch(source.HubSource("org/bins"), tmp_path / "d")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ModelLoadError, match="HF_TOKEN is missing or has no access"):
        source.fetch(source.HubSource("org/tiny"), tmp_path / "e")
    with pytest.raises(ModelLoadError, match="expected hf://org/name"):
        source.HubSource.parse("hf://just-a-name")


def test_an_hf_model_resolves_into_the_cache_and_loads_the_same_weights(
    hub: HubServer, tiny: tuple[Path, Path]
) -> None:
    old, _ = tiny
    path = resolve_model_path("hf://org/tiny@v1")
    assert path == Path(os.environ["GEARSHIFT_MODEL_CACHE"]) / "org--tiny--v1"
    cpu = torch.device("cpu")
    models = []
    for model in ("hf://org/tiny@v1", str(old)):
        spec, weights = inspect_model(EngineConfig(model=model, dtype="float32"), cpu)
        models.append(load_model(spec, weights, cpu).state_dict())
    assert models[0].keys() == models[1].keys()
    for key, value in models[0].items():
        assert torch.equal(value, models[1][key]), key


@pytest.mark.slow
def test_fetch_model_command_downloads_or_fails_with_the_reason(
    hub: HubServer, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    old, _ = tiny
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "fetch-model"]
    dest = tmp_path / "dest"
    done = subprocess.run(
        [*cmd, "hf://org/tiny", "--revision", "v1", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert _weights(dest) == _weights(old)
    done = subprocess.run(
        [*cmd, "hf://org/missing", "--dest", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "hf://org/missing: repository not found" in done.stderr


@pytest.mark.slow
def test_serve_with_a_missing_hf_repo_exits_naming_it(hub: HubServer, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", "serve", "--model", "hf://org/gone"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "hf://org/gone: repository not found" in done.stderr


@pytest.mark.parametrize(
    "uri", ["hf://org/tiny@../../etc", "hf://org/tiny@refs/pr/1", "hf://org/tiny@a..b"]
)
def test_a_revision_that_is_a_path_is_refused_before_anything_is_fetched(
    uri: str, tmp_path: Path
) -> None:
    """It would name a folder under the cache (fetch_to_cache) and a URL path."""
    with pytest.raises(ModelLoadError, match=r"no '/', no '\.\.'"):
        source.HubSource.parse(uri)
    with pytest.raises(ModelLoadError, match="revision"):
        source.fetch_to_cache(uri, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "etc").exists()
    with pytest.raises(ModelLoadError, match="revision"):
        source.HubSource.parse("hf://org/tiny", "../x")
