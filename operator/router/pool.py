"""The router's backend groups: which serve, which gets the next request, reconfiguration."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from gearshift.operator.router import errors
from gearshift.operator.router.config import GroupSpec
from gearshift.operator.router.group import Group, Lease, WorkerGroup
from gearshift.operator.router.openai_backend import OpenAIGroup
from gearshift.worker.server import auth

log = logging.getLogger(__name__)


# router.json `backend` → the group kind that speaks it (docs/operator.md).
GROUP_KINDS: dict[str, type[Group]] = {
    "worker-grpc": WorkerGroup,
    "openai-http": OpenAIGroup,
}


class GroupPool:
    """Routes each request to the serving group with the fewest outstanding tokens."""

    def __init__(
        self,
        max_requests_per_group: int,
        poll_interval_s: float,
        rpc_timeout_s: float,
        backend: str = "worker-grpc",
        token: auth.TokenSource | str | None = None,
        queue_timeout_s: float = 600.0,
    ) -> None:
        if backend not in GROUP_KINDS:
            raise ValueError(f"unknown backend {backend!r}; one of {', '.join(GROUP_KINDS)}")
        self.kind = GROUP_KINDS[backend]
        # The control token, for every group's Worker calls (followed for rotation).
        self.token = auth.token_source(token)
        self.max_requests_per_group = max_requests_per_group
        self.poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        # How long a request may wait for room on its group (room_queue.py) before a 503.
        self.queue_timeout_s = queue_timeout_s
        self.groups: dict[str, Group] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._turn = 0  # breaks ties between equally loaded groups in turn

    # ---- membership -----------------------------------------------------------------------

    async def configure(self, specs: Iterable[GroupSpec]) -> None:
        """Make the pool match `specs`: add new groups, retire missing or moved ones."""
        wanted = {s.name: s for s in specs}
        for name, group in list(self.groups.items()):
            if name not in wanted or wanted[name].address != group.spec.address:
                await self._retire(group)
        for name, spec in wanted.items():
            if name not in self.groups:
                group = self.kind(spec, self.rpc_timeout_s, self.token)
                self.groups[name] = group
                self._pollers[name] = asyncio.create_task(
                    group.run_poller(self.poll_interval_s), name=f"poll-{name}"
                )
                log.info("group %s at %s added", name, spec.address)
        await asyncio.gather(*(g.poll() for g in self.groups.values()))

    async def _retire(self, group: Group) -> None:
        """Stop routing to a group now; close its channel once its requests finished."""
        log.info("group %s removed; closing when idle", group.name)
        group.removed = True
        group.room.fail_all(f"group {group.name} was removed while the request waited for room")
        self.groups.pop(group.name, None)
        poller = self._pollers.pop(group.name, None)
        if poller is not None:
            poller.cancel()

        async def close_when_idle() -> None:
            if group.load.in_flight:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(group.finished.wait(), 600)
            await group.close()

        asyncio.get_running_loop().create_task(close_when_idle())

    async def close(self) -> None:
        for poller in self._pollers.values():
            poller.cancel()
        await asyncio.gather(*(g.close() for g in self.groups.values()))

    # ---- state ----------------------------------------------------------------------------

    def get(self, name: str) -> Group | None:
        return self.groups.get(name)

    def serving(self) -> list[Group]:
        return [g for g in self.groups.values() if g.serving]

    @property
    def ready(self) -> bool:
        """At least one group serves."""
        return any(g.serving for g in self.groups.values())

    @property
    def in_flight(self) -> int:
        return sum(g.load.in_flight for g in self.groups.values())

    @property
    def max_model_len(self) -> int | None:
        """The served context length, as the backends report it (None before any answered)."""
        for g in self.groups.values():
            if g.stats is not None and g.stats.max_model_len:
                return int(g.stats.max_model_len)
        return None

    # ---- routing --------------------------------------------------------------------------

    def check_admission(self) -> None:
        """The 429 `acquire` would answer now: asked before a request is prepared, so a full
        server spends nothing on it. (With no group serving, `acquire` answers 503 later: a
        request is still checked, so a bad one hears what is wrong with it.)"""
        serving = self.serving()
        if serving and all(g.load.in_flight >= self.max_requests_per_group for g in serving):
            raise self._full()

    def _full(self) -> errors.APIError:
        return errors.overloaded(
            f"the server is at capacity ({self.max_requests_per_group} requests per group "
            f"in flight on {len(self.serving())} groups); retry later"
        )

    def acquire(self, prompt_tokens: int, max_tokens: int, exclude: set[str]) -> Lease:
        """A lease on the least loaded serving group not in `exclude`.

        Raises 503 when no group serves (or every one was tried) and 429 when every serving
        group already has max_requests_per_group requests in flight.
        """
        candidates = [g for g in self.serving() if g.name not in exclude]
        if not candidates:
            if not self.ready:
                raise errors.unavailable("no worker group is serving")
            raise errors.unavailable("every serving worker group failed this request")
        free = [g for g in candidates if g.load.in_flight < self.max_requests_per_group]
        if not free:
            raise self._full()
        self._turn += 1
        order = list(self.groups)

        def key(target: tuple[Group, int | None]) -> tuple[int, int, int, int]:
            g, r = target
            load = g.load if r is None else g.replicas[r]
            turn = (order.index(g.name) - self._turn) % len(order)
            return (load.outstanding_tokens + load.others, load.in_flight, turn, r or 0)

        # Every engine replica is a routing target of its own (a group that reports several:
        # SiDP); the per-group request limit still bounds what one endpoint takes.
        targets = [(g, r) for g in free for r in (range(len(g.replicas)) or [None])]
        group, replica = min(targets, key=key)
        return Lease(group, prompt_tokens, max_tokens, replica)
