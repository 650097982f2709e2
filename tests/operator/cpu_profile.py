"""A real calibration profile for the operator's tests: ``gearshift profile --layouts`` run on this
CPU for a tiny random Llama (about 20 s), and the model's shape as ``spec.policy.auto.model``. The
profile records that shape and dtype (``model_shape``, ``dtype``), which a deployment planned from
it must have: its ``spec.model.dtype`` is to be ``DTYPE``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

LAYOUTS = ("tp2", "pp2")  # two of the four 2-GPU layouts: the plan must exclude sp2 and shift2
HIDDEN, LAYERS = 64, 2
DTYPE = "float32"  # the profile's (--dtype); a deployment's spec.model.dtype must agree
# random_llama's config (benchmarks/sim_fidelity.py) in the CRD's camelCase.
MODEL = {
    "numHiddenLayers": LAYERS,
    "hiddenSize": HIDDEN,
    "numAttentionHeads": 8,
    "numKeyValueHeads": 2,
    "intermediateSize": 4 * HIDDEN,
    "vocabSize": 49152,
    "torchDtype": DTYPE,
}
# What NVIDIA's driver calls an H100 SXM (the name a profile measured on one carries).
H100_NAME = "NVIDIA H100 80GB HBM3"


def measure(folder: Path) -> Path:
    """Profile ``LAYOUTS`` of a random Llama on this CPU; the profile file's path."""
    from benchmarks.sim_fidelity import random_llama

    model = random_llama(folder / "model", hidden=HIDDEN, layers=LAYERS)
    out = folder / "profile.json"
    subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", "profile", "--model", str(model),
         "--quick", "--layouts", ",".join(LAYOUTS), "--dtype", DTYPE, "--max-model-len",
         "1024", "--max-num-batched-tokens", "512", "--num-threads", "1", "-o", str(out)],
        check=True, timeout=300, capture_output=True, cwd=folder,
    )  # fmt: skip
    return out


def as_measured_on(text: str, device: str) -> str:
    """The measured profile as if its device were ``device`` (cuda). There is no GPU here, so the
    step costs stay this CPU's: what the operator's tests check is that the plan takes them from
    the ConfigMap, not what they are. Only the device name and kind change."""
    data: dict[str, Any] = json.loads(text)
    data.update(device=device, device_kind="cuda")
    return json.dumps(data)
