"""The n choices of one request: n (or best_of) child sequences run at once, like vLLM v1's
parallel sampling, merged into one stream of index-tagged deltas.

Each child is its own worker request (its own routing and retry). A child that fails before
any child produced a token fails the whole request with its error; later failures end the
stream with an error, as for one sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gearshift.operator.router.generate import RequestRun, RunResult, TokenDelta


@dataclass
class ChoiceResult:
    """One finished child: its deltas, in order, and its cumulative logprob (for best_of)."""

    index: int
    result: RunResult
    deltas: list[TokenDelta] = field(default_factory=list)
    cumulative_logprob: float = 0.0


class Choices:
    """Runs child requests concurrently; `close` (or leaving `stream`) cancels what is left."""

    def __init__(
        self, runs: list[RequestRun], n: int, per_prompt: int, on_close: Callable[[], None]
    ) -> None:
        self.runs = runs  # per_prompt (best_of, else n) children for each prompt, in order
        self.n = n
        self.per_prompt = per_prompt
        self._on_close = on_close
        self._closed = False

    @property
    def results(self) -> list[RunResult]:
        return [r.result for r in self.runs]

    @property
    def num_choices(self) -> int:
        return len(self.runs) // self.per_prompt * self.n

    def usage(self) -> RunResult:
        """The request's usage: each prompt once, the completions of every child (vLLM's sum)."""
        firsts = [r.result for r in self.runs[:: self.per_prompt]]
        return RunResult(
            prompt_tokens=sum(r.prompt_tokens for r in firsts),
            completion_tokens=sum(r.result.completion_tokens for r in self.runs),
            cached_tokens=sum(r.cached_tokens for r in firsts),
        )

    async def stream(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        """(child index, delta) as the children produce them."""
        queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, run: RequestRun) -> None:
            try:
                async with contextlib.aclosing(run.deltas()) as deltas:
                    async for delta in deltas:
                        await queue.put((index, delta))
            except BaseException as exc:
                await queue.put((index, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(self.runs)]
        pending = set(tasks)

        def child_done(task: asyncio.Future[None]) -> None:
            # Every child ended: the id is free even if nobody reads (or closes) this stream.
            pending.discard(task)
            if not pending:
                self.close()

        for task in tasks:
            task.add_done_callback(child_done)
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            # Synchronous first: inside a cancelled (anyio) scope every await below raises
            # again, and the id must be freed and the children cancelled all the same.
            for task in tasks:
                task.cancel()
            self.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[ChoiceResult]:
        """Every child to the end; per prompt, the n best by cumulative logprob (best_of > n).

        Choice indices run prompt by prompt (prompt k's choices are k·n … k·n + n − 1), as
        in vLLM.
        """
        results = [ChoiceResult(i, r.result) for i, r in enumerate(self.runs)]
        async for index, delta in self.stream():
            results[index].deltas.append(delta)
            if delta.logprob is not None:
                results[index].cumulative_logprob += delta.logprob.logprob
        kept: list[ChoiceResult] = []
        for start in range(0, len(results), self.per_prompt):
            group = results[start : start + self.per_prompt]
            best = sorted(group, key=lambda r: (-r.cumulative_logprob, r.index))[: self.n]
            kept += sorted(best, key=lambda r: r.index)
        for new_index, result in enumerate(kept):
            result.index = new_index
        return kept

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close()
