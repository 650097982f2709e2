"""One rank of the p2p tests: a real gloo group over a file store, one scenario, its findings
written to ``<out>/rank-<r>.json``. Scenarios that plant a violation record the error text;
ranks meet on the store (``done``) before they leave, so no rank's exit is what a peer sees."""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, CommRules, Recv, RuleViolation, Send, start_rules

TIMEOUT = timedelta(seconds=60)


def _error(fn: Any) -> str:
    try:
        fn()
    except (RuleViolation, RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def roundtrip(rank: int, chan: P2P) -> dict[str, Any]:
    """Both directions as one exchange, FIFO order of same-label messages, an empty message, a
    non-contiguous receive buffer, then sequential send-then-receive."""
    peer = 1 - rank
    mine = torch.arange(6, dtype=torch.float32) + 10 * rank
    got = torch.empty(6)
    chan.exchange([Send(peer, mine, "swap"), Recv(peer, got, "swap")]).wait()
    out: dict[str, Any] = {"swap": got.tolist()}
    if rank == 0:
        for i in range(3):
            chan.send(torch.full((2,), float(i)), 1, "fifo").wait()
        chan.send(torch.empty(0, 4), 1, "empty").wait()
        chan.send(torch.arange(6, dtype=torch.int64).view(2, 3), 1, "strided").wait()
        back = torch.empty(3, dtype=torch.int64)
        chan.recv(back, 1, "back").wait()
        out["back"] = back.tolist()
    else:
        out["fifo"] = []
        for _ in range(3):
            buf = torch.empty(2)
            chan.recv(buf, 0, "fifo").wait()
            out["fifo"].append(buf[0].item())
        empty = torch.empty(0, 4)
        chan.recv(empty, 0, "empty").wait()
        wide = torch.zeros(3, 2, dtype=torch.int64)
        chan.recv(wide.t(), 0, "strided").wait()  # a transposed view: received, then copied in
        out["strided"] = wide.t().tolist()
        chan.send(torch.tensor([7, 8, 9]), 0, "back").wait()
    return out


def out_of_order(rank: int, chan: P2P) -> dict[str, Any]:
    """Rank 0 sends 'a' then 'b'; rank 1 receives 'b' first (tags once paired these)."""
    if rank == 0:
        chan.send(torch.ones(2), 1, "a")
        chan.send(torch.ones(2), 1, "b")
        return {}
    first = chan.recv(torch.empty(2), 0, "b")
    chan.recv(torch.empty(2), 0, "a")
    return {"error": _error(first.wait)}


def wrong_shape(rank: int, chan: P2P) -> dict[str, Any]:
    """A payload longer than its receive (plain gloo aborts the process on this one)."""
    if rank == 0:
        chan.send(torch.ones(3), 1, "rows")
        return {}
    return {"error": _error(chan.recv(torch.empty(2), 0, "rows").wait)}


def wrong_dtype(rank: int, chan: P2P) -> dict[str, Any]:
    if rank == 0:
        chan.send(torch.ones(2, dtype=torch.int64), 1, "ids")
        return {}
    return {"error": _error(chan.recv(torch.empty(2), 0, "ids").wait)}


def tagged(rank: int, chan: P2P) -> dict[str, Any]:
    """A tag straight through torch.distributed, as isend and as a batch's P2POp."""
    del chan
    if rank == 1:
        return {}
    return {
        "isend": _error(lambda: dist.isend(torch.ones(1), 1, tag=5)),
        "p2pop": _error(lambda: dist.P2POp(dist.irecv, torch.ones(1), 1, tag=6)),
    }


def opposite(rank: int, chan: P2P) -> dict[str, Any]:
    """Rank 0 posts a receive from rank 1 while its send to rank 1 is not waited for (refused
    under the rules, allowed plain); sequential and batched opposite directions are fine."""
    out: dict[str, Any] = {}
    if rank == 0:
        sent = chan.send(torch.ones(2), 1, "x")
        back = torch.empty(2)
        try:
            posted = chan.recv(back, 1, "y")
            out["error"] = ""
        except RuleViolation as exc:
            posted, out["error"] = None, f"RuleViolation: {exc}"
        sent.wait()
        (posted or chan.recv(back, 1, "y")).wait()  # once the send is waited for: allowed
        out["back"] = back.tolist()
    else:
        chan.recv(torch.empty(2), 0, "x").wait()
        chan.send(torch.full((2,), 2.0), 0, "y").wait()
    peer = 1 - rank
    got = torch.empty(1)
    chan.exchange([Recv(peer, got, "both"), Send(peer, torch.tensor([float(rank)]), "both")]).wait()
    out["batched"] = got.item()
    return out


def dead_peer(rank: int, chan: P2P) -> dict[str, Any]:
    """Rank 1 answers twice, then is killed while rank 0 waits for its third answer."""
    if rank == 1:
        for i in range(2):
            chan.recv(torch.empty(1), 0, f"ask {i}").wait()
            chan.send(torch.tensor([float(i)]), 0, f"answer {i}").wait()
        chan.recv(torch.empty(1), 0, "ask 2").wait()
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(3):
        chan.send(torch.zeros(1), 1, f"ask {i}").wait()
        if i < 2:
            chan.recv(torch.empty(1), 1, f"answer {i}").wait()
    # Rank 1 may already be dead when the receive is posted: gloo then fails the post itself.
    return {"error": _error(lambda: chan.recv(torch.empty(1), 1, "answer 2").wait())}


def ring3(rank: int, chan: P2P) -> dict[str, Any]:
    """Three ranks pass a value round the ring, each step one batch (send next, receive prev)."""
    value = torch.tensor([float(rank)])
    seen = []
    for step in range(3):
        incoming = torch.empty(1)
        ops = [
            Send((rank + 1) % 3, value, f"ring {step}"),
            Recv((rank - 1) % 3, incoming, f"ring {step}"),
        ]
        chan.exchange(ops).wait()
        value = incoming
        seen.append(int(value.item()))
    return {"seen": seen}


SCENARIOS = {
    f.__name__: f
    for f in (roundtrip, out_of_order, wrong_shape, wrong_dtype, tagged, opposite, dead_peer, ring3)
}


def run_rank(
    rank: int, world: int, store_path: str, out: str, scenario: str, rules: str, nccl: bool = False
) -> None:
    """``nccl``: one GPU per rank, device tensors over NCCL (its rules: ``rules`` only refuses
    tags and ungrouped opposite directions there)."""
    os.environ["GEARSHIFT_COMM_RULES"] = rules
    start_rules()
    store = dist.FileStore(store_path, world)
    device = torch.device("cpu")
    if nccl:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20),
            device_id=device,
        )  # fmt: skip
        torch.set_default_device(device)  # the scenarios' tensors are device tensors
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    comm = CommGroup(world, rank, tuple(range(world)), dist.group.WORLD)
    chan = P2P(comm, scenario, device, TIMEOUT, CommRules(rules))
    result = SCENARIOS[scenario](rank, chan)
    if nccl:
        torch.cuda.synchronize(device)
        result["device"] = str(device)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    if scenario != "dead_peer":
        store.set(f"done-{rank}", "1")
        store.wait([f"done-{r}" for r in range(world)], TIMEOUT)
    sys.stdout.flush()
    os._exit(0)  # a planted violation leaves messages unreceived: no orderly teardown
