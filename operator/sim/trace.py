"""A request trace: arrival time and prompt/output lengths per request, saved as JSONL.

One line per request: ``{"arrival_s": 0.25, "prompt_tokens": 312, "output_tokens": 64}``. The
router's ``--record-trace`` writes the same fields (plus ones replay ignores), so a recorded trace
replays as it was served.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace file or parameter is invalid; the message names the line or field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request as the simulator sees it: when it arrives and how long it is."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise TraceError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise TraceError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise TraceError(f"output_tokens must be >= 1, got {self.output_tokens}")


def save(requests: Iterable[TraceRequest], path: Path) -> None:
    lines = [
        json.dumps(
            {
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
            }
        )
        for r in requests
    ]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def load(path: Path) -> list[TraceRequest]:
    """A trace in arrival order, times shifted so the first request arrives at 0.

    Recorded lines are written when a request finishes, so they are sorted here.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from exc
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(
                TraceRequest(
                    float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{path}:{n}: {exc!r}") from None
    out.sort(key=lambda r: r.arrival_s)
    start = out[0].arrival_s if out else 0.0
    return [TraceRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens) for r in out]
