"""gearshift.worker.p2p over NCCL, one GPU per rank (marked gpu; needs two GPUs: NCCL refuses two
ranks on one device, so a one-GPU host skips these): messages arrive as sent, batches included;
a peer killed mid-exchange ends the waiting rank's process within the group's timeout (NCCL's
watchdog with TORCH_NCCL_ASYNC_ERROR_HANDLING=1). Groups over NCCL: TP 2 and SiDP CaS with one
GPU per replica give one process's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gearshift.worker.launch.processes import run_ranks
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.p2p import p2p_driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL between ranks needs a GPU per rank (two GPUs)",
    ),
]


def _run(tmp: Path, scenario: str) -> tuple[list[int | None], dict[int, dict]]:
    args = [(r, 2, str(tmp / "store"), str(tmp), scenario, "nccl", True) for r in range(2)]
    codes = run_ranks(p2p_driver.run_rank, args, f"nccl-{scenario}", 120)
    got = {}
    for r in range(2):
        path = tmp / f"rank-{r}.json"
        if path.is_file():
            got[r] = json.loads(path.read_text())
    return codes, got


def test_device_tensors_cross_nccl_as_sent_with_batches(tmp_path):
    codes, got = _run(tmp_path, "roundtrip")
    assert codes == [0, 0]
    assert got[0]["swap"] == [10.0 + i for i in range(6)] and got[1]["fifo"] == [0.0, 1.0, 2.0]
    assert got[0]["device"] == "cuda:0" and got[1]["device"] == "cuda:1"


def test_a_peer_killed_mid_exchange_ends_the_waiting_rank_within_the_timeout(tmp_path):
    codes, _ = _run(tmp_path, "dead_peer")
    # Rank 0 waits on a receive from the killed rank: NCCL's watchdog aborts the communicator
    # and ends the process after the group's 20 s timeout (run_ranks would kill it at 120 s).
    assert codes[1] == -9 and codes[0] not in (0, None, -9), codes


def test_tp2_over_nccl_gives_one_process_tokens(tiny_checkpoint, group_factory, engine_factory):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    gpu = {"device": "cuda", "attention_backend": "torch", "skip_tokenizer_init": True}
    want = [
        o.token_ids for o in engine_factory(folder, record=False, **gpu).generate(prompts, params)
    ]
    engine = group_factory(folder, {"static": {"tp": 2, "pp": 1}}, record=False, **gpu)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    engine_pp = group_factory(folder, {"static": {"pp": 2}}, record=False, **gpu)
    assert engine_pp.executor.logits_channel.backend == "nccl"
    assert [o.token_ids for o in engine_pp.generate(prompts, params)] == want
