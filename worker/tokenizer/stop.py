"""Stop strings over streamed text: cut exactly at the first one, even across delta boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What one `StopChecker.feed` call decided: text safe to emit, and whether to stop."""

    text: str
    stopped: bool = False
    stop_str: str | None = None


class StopChecker:
    """Consumes text deltas; holds back any tail that could still grow into a stop string.

    The match chosen is the one that completes first while reading left to right (ties: the
    longer one), so the result does not depend on how the text was split into deltas.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in self._stop), default=0)
        # Excluding the stop string: text not yet emitted. Including it: nothing is held back,
        # and this keeps the emitted tail a stop string could have started in.
        self._pending = ""
        self._stopped: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen (every later delta is dropped)."""
        return self._stopped is not None

    def feed(self, delta: str) -> StopResult:
        """Add `delta`; return the text that can be emitted now and whether generation stops."""
        if self._stopped is not None:
            return StopResult("", True, self._stopped)
        if not self._stop:
            return StopResult(delta)
        text = self._pending + delta
        # Where this call's output starts: pending text was already emitted when including.
        start = len(self._pending) if self._include else 0
        match = self._first_match(text, len(self._pending))
        if match is not None:
            index, stop_str = match
            self._pending = ""
            self._stopped = stop_str
            end = index + len(stop_str) if self._include else index
            return StopResult(text[start:end], True, stop_str)
        if self._include:
            self._pending = (
                text[max(0, len(text) - self._longest + 1) :] if self._longest > 1 else ""
            )
            return StopResult(text[start:])
        keep = self._partial_suffix_length(text)
        self._pending = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep])

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (EOS, length)."""
        held = "" if self._include else self._pending
        self._pending = ""
        return held

    def _first_match(self, text: str, old_length: int) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self._stop:
            # Pending text held no complete match, so a new one must end inside the delta.
            index = text.find(stop_str, max(0, old_length - len(stop_str) + 1))
            if index < 0:
                continue
            candidate = (index + len(stop_str), index, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return (best[1], best[2]) if best is not None else None

    def _partial_suffix_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop_str in self._stop:
            for size in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:size]):
                    longest = size
                    break
        return longest
