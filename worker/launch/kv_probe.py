"""A replica's KV capacity, measured: admit sequences until the first preemption.

The figure a formula gives (bytes over bytes per block) says what was allocated; this says what
a running replica really holds. Each probe sends one batch of fresh sequences to one replica,
all admitted in its first step (the caller's engine takes ``max_num_seqs`` and
``max_num_batched_tokens`` of at least the block count and the block count times the block size),
lets them finish, and reads whether the scheduler preempted any. A "long" sequence holds two
blocks once it decodes (a one-block prompt, then a token that needs a second block at the very
next step); a "short" one holds one block (a one-token prompt that decodes to the block's end).
The probe ramps the long ones (doubling, then bisecting) to the most that run without a
preemption, then adds short ones until one more preempts. The capacity is the KV tokens of the
largest batch that ran without one: every token of it was written into the cache at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.replicas import ReplicaGroup
from gearshift.worker.sampling.params import SamplingParams


@dataclass
class KvProbe:
    """What the probes found on one replica (tokens are KV tokens held at once)."""

    block_size: int
    long_seqs: int = 0  # two-block sequences of the largest batch that ran without preemption
    short_seqs: int = 0  # one-block sequences added to it
    probes: list[tuple[int, int, bool]] = field(default_factory=list)  # (long, short, preempted)

    @property
    def tokens(self) -> int:
        return (2 * self.long_seqs + self.short_seqs) * self.block_size


@dataclass
class _Prober:
    group: ReplicaGroup
    replica: int
    block_size: int
    vocab: int
    timeout_s: float
    seed: int = 0
    result: KvProbe = field(init=False)

    def __post_init__(self) -> None:
        self.result = KvProbe(self.block_size)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._sent = 0

    def _seq(self, prompt_len: int, max_tokens: int) -> tuple[str, list[int], SamplingParams]:
        # Fresh random prompts: no block of one matches another's, so the prefix cache shares
        # nothing (checked in ``preempts``).
        self._sent += 1
        ids = torch.randint(0, self.vocab, (prompt_len,), generator=self._gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return (f"kv-probe-{self.replica}-{self._sent}", ids, params)

    def preempts(self, long: int, short: int) -> bool:
        """Run ``long`` two-block and ``short`` one-block sequences at once; did any preempt?"""
        bs = self.block_size
        # Long: bs prompt tokens fill a block; decoding bs + 1 tokens writes bs more KV tokens.
        # Short: 1 prompt token, bs generated: KV of bs tokens (the last sampled one is not
        # written), one block.
        seqs = [self._seq(bs, bs + 1) for _ in range(long)]
        seqs += [self._seq(1, bs) for _ in range(short)]
        before = self.group.stats(self.replica)["engine"]
        pending = self.group.submit({self.replica: seqs})
        results: dict[str, tuple[list[int], str]] = {}
        deadline = time.monotonic() + self.timeout_s
        while any(pending.values()):
            if time.monotonic() > deadline:
                raise GroupFailure(f"KV probe of {long}+{short} sequences unfinished")
            self.group.poll(pending, results, wait_s=0.005)
        failed = [rid for rid, (_, reason) in results.items() if reason.startswith("error")]
        if failed:
            raise RuntimeError(f"KV probe: requests refused: {results[failed[0]][1]}")
        after = self.group.stats(self.replica)["engine"]
        preempted = after.num_preemptions > before.num_preemptions
        # (A preempted sequence, recomputed, may hit its own freed blocks: only then.)
        if not preempted and after.prefix_cache_hit_tokens != before.prefix_cache_hit_tokens:
            raise RuntimeError("KV probe: the prefix cache shared blocks; the count is not KV held")
        self.result.probes.append((long, short, preempted))
        return preempted

    def most(self, fits: int, limit: int, preempts: Callable[[int], bool]) -> int:
        """The largest n in [fits, limit) for which ``preempts(n)`` is False (``fits`` known to
        run), doubling and then bisecting; ``limit`` is where the search gives up."""
        lo, hi = fits, None
        n = max(1, 2 * fits)
        while hi is None:
            if n >= limit:
                raise RuntimeError(f"KV probe: {n} sequences ran without a preemption")
            if preempts(n):
                hi = n
            else:
                lo, n = n, 2 * n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if preempts(mid):
                hi = mid
            else:
                lo = mid
        return lo


def measure_kv_capacity(
    group: ReplicaGroup,
    replica: int,
    block_size: int,
    vocab: int,
    max_seqs: int,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> KvProbe:
    """Replica ``replica``'s KV capacity in tokens, by admitting sequences until the first
    preemption (``max_seqs``: the most sequences a probe may send, the engine's
    ``max_num_seqs``)."""
    prober = _Prober(group, replica, block_size, vocab, timeout_s, seed)
    long = prober.most(0, max_seqs + 1, lambda n: prober.preempts(n, 0))
    short = prober.most(0, max_seqs + 1 - long, lambda n: prober.preempts(long, n))
    prober.result.long_seqs, prober.result.short_seqs = long, short
    return prober.result
