"""The router's rule, in simulated time: fewest outstanding tokens (operator/router/pool.py).

A request's outstanding tokens are its prompt plus its max tokens until the first token comes
back; then each token returned takes one off, and the rest is released when it finishes
(group.py's ``Lease``). Ties go to the replica with fewer requests in flight, then round robin.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Load:
    outstanding: int = 0
    in_flight: int = 0


@dataclass
class _Lease:
    replica: int
    prompt_tokens: int
    remaining: int
    first: bool = True


@dataclass
class LeastOutstandingRouter:
    """Picks a replica per request and follows each request's tokens as they come back."""

    replicas: int
    loads: list[_Load] = field(init=False)
    leases: dict[str, _Lease] = field(default_factory=dict)
    _turn: int = 0

    def __post_init__(self) -> None:
        self.loads = [_Load() for _ in range(self.replicas)]

    def pick(self, rid: str, prompt_tokens: int, max_tokens: int) -> int:
        self._turn += 1
        n = self.replicas
        best = min(
            range(n),
            key=lambda i: (
                self.loads[i].outstanding,
                self.loads[i].in_flight,
                (i - self._turn) % n,
            ),
        )
        lease = _Lease(best, prompt_tokens, prompt_tokens + max_tokens)
        self.leases[rid] = lease
        self.loads[best].outstanding += lease.remaining
        self.loads[best].in_flight += 1
        return best

    def on_tokens(self, rid: str, n: int, finished: bool) -> None:
        lease = self.leases[rid]
        used = min(lease.remaining, n + (lease.prompt_tokens if lease.first else 0))
        lease.first = False
        lease.remaining -= used
        load = self.loads[lease.replica]
        load.outstanding -= used
        if finished:
            load.outstanding -= lease.remaining
            load.in_flight -= 1
            del self.leases[rid]
