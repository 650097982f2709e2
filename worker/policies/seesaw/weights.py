"""Seesaw §4.1 dynamic re-sharding from host copies: each rank keeps, in host memory (pinned when
CUDA is present), the shards both gears need, read once from the checkpoint; one device working
set the size of the larger gear holds the active gear's weights. A switch copies the next gear's
shards into the working set; the other gear's parameters point at nothing meanwhile.

At start each gear is stashed (``add``) as soon as it is built, before the next one is: the
device never holds two shards, and the working set comes after the last (``allocate``), so the
start-up peak is one shard (then one shard plus the KV cache, which is sized after it).

On CPU the same code runs with the device being the CPU: the working set is still a separate
buffer, so a re-shard costs what it would cost over PCIe minus the bus.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from gearshift.worker.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every view starts aligned for vector loads and any dtype


@dataclass(frozen=True)
class Reshard:
    """One switch of the working set: which gear, how many bytes, how long."""

    gear: int
    bytes: int
    seconds: float


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():  # tied weights (embedding = LM head) appear once
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class WeightSet:
    """Host copies of every gear's shard on this rank and the one device working set."""

    def __init__(self, models: list[LlamaForCausalLM], device: torch.device, packing: str) -> None:
        """``models``: gears built already (stashed and the working set allocated now); none:
        ``add`` each as it is built, then ``allocate``."""
        self.models: list[LlamaForCausalLM] = []
        self.device = device
        self.packing = packing
        self.host: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
        self.gear_bytes: list[int] = []
        self.working = torch.empty(0, dtype=torch.uint8, device=device)
        self.active: int | None = None
        self.history: list[Reshard] = []
        for model in models:
            self.add(model)
        if models:
            self.allocate()

    def add(self, model: LlamaForCausalLM) -> None:
        """Move a just-built gear's parameters to host memory (pinned on CUDA); its device
        copies are released (on CUDA the caching allocator keeps them until empty_cache)."""
        pin = self.device.type == "cuda"
        entries = []
        for p in _unique_parameters(model):
            host = p.data if p.device.type == "cpu" else p.data.cpu()
            if pin:
                host = host.pin_memory()
            entries.append((p, host))
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)  # not resident yet
        self.models.append(model)
        self.host.append(entries)
        self.gear_bytes.append(sum(self._aligned(h.numel() * h.element_size()) for _, h in entries))

    def allocate(self) -> torch.Tensor:
        """The device working set: the larger gear's shard."""
        self.working = torch.empty(
            max(self.gear_bytes, default=0), dtype=torch.uint8, device=self.device
        )
        return self.working

    @staticmethod
    def _aligned(n: int) -> int:
        return -(-n // _ALIGN) * _ALIGN

    def activate(self, gear: int, record: bool = True) -> Reshard:
        """Load ``gear``'s shards into the working set (the other gear is released). Each gear's
        shards land at the same offsets every time, so graphs captured on them stay valid;
        ``record``: False for start-up switches (graph capture), which are no transitions."""
        start = time.perf_counter()
        if self.active is not None:
            for p, _ in self.host[self.active]:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        offset = 0
        for p, host in self.host[gear]:
            n = host.numel() * host.element_size()
            view = self.working[offset : offset + n].view(host.dtype).view(host.shape)
            view.copy_(host, non_blocking=True)
            p.data = view
            offset += self._aligned(n)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # Packed copies and the fused-decode arguments point at the weights: rebuild them.
        self.models[gear].pack_weights(self.packing)
        self.active = gear
        done = Reshard(gear, self.gear_bytes[gear], time.perf_counter() - start)
        if record:
            self.history.append(done)
        log.info(
            "seesaw re-shard to gear %d: %.1f MiB in %.3f s", gear, done.bytes / 2**20, done.seconds
        )
        return done


def checksums(model: nn.Module) -> dict[str, str]:
    """sha256 of every parameter's bytes, by name (tests compare shards with these)."""
    out = {}
    for name, p in model.named_parameters():
        data = p.detach().to("cpu").contiguous()
        out[name] = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out
