"""``--record-trace PATH``: one JSONL line per finished request, replayable by the simulator.

Fields: ``arrival_s`` (seconds since the recorder opened, monotonic clock), ``prompt_tokens``,
``output_tokens`` and ``finish_reason``; ``gearshift.operator.sim.trace.load`` reads them. Lines
are written when a request ends, so they are not in arrival order (the loader sorts). Each line is
flushed at once, so a router killed mid-run leaves every finished request on disk.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO


class TraceRecorder:
    """Appends finished requests to a JSONL file (the router's one event loop calls it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.origin = time.monotonic()
        self._file: TextIO | None = path.open("w", encoding="utf-8")

    def record(
        self, arrival_time: float, prompt_tokens: int, output_tokens: int, finish_reason: str
    ) -> None:
        """``arrival_time`` is a ``time.monotonic()`` reading."""
        if self._file is None:
            return
        row = {
            "arrival_s": round(max(0.0, arrival_time - self.origin), 6),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "finish_reason": finish_reason,
        }
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
