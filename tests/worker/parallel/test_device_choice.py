"""Which device and backend a rank takes: ``cuda`` is one GPU per local rank over NCCL,
``cuda:N`` pins every rank of the host to GPU N over gloo (NCCL refuses two ranks on one GPU),
and a rank with no GPU to take is refused naming ``device``."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch.rank import device_for, group_backend


@pytest.mark.parametrize(
    ("device", "rank_device", "backend"),
    [
        ("cpu", torch.device("cpu"), "gloo"),
        ("cuda", torch.device("cuda", 1), "nccl"),
        ("cuda:0", torch.device("cuda", 0), "gloo"),
    ],
)
def test_the_backend_follows_how_ranks_map_to_gpus(device, rank_device, backend):
    assert group_backend(EngineConfig(model="m", device=device), rank_device) == backend


def test_a_local_rank_beyond_the_visible_gpus_is_refused_naming_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidRequestError) as err:
        device_for(EngineConfig(model="m", device="cuda"), local_rank=1)
    assert err.value.field == "device"
    assert "GPU 1" in str(err.value) and "shows 1" in str(err.value)
    with pytest.raises(InvalidRequestError, match="GPU 3"):
        device_for(EngineConfig(model="m", device="cuda:3"), local_rank=0)
