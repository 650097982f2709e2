"""``gearshift plan``'s progress bar (issue 30): its phases one after the other (the candidates'
lower bounds, then the simulated points), each with a total that is the work left as far as it is
known, never less, and an ETA that does not read 00:00 while work is left.

``Progress`` drives any tqdm-like bar (``n``, ``total``, ``update``, ``refresh``; ``reset`` and
``set_description_str`` when it has them), so a test can hand it a recorder. ``plan_bar`` is the
command's tqdm bar: its ETA rounds up, so a last point that takes 0.6 s reads 00:01, not 00:00.
"""

from __future__ import annotations

import math
from typing import Any

# tqdm's default right-hand side, with ``remaining`` the rounded-up ETA below.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
    """One phase at a time on ``bar`` (None: nothing shown). ``phase`` starts one from zero with
    the most work it can take; ``done`` counts work finished, ``drop`` takes off the total work
    that is now known not to be needed. The caller keeps ``total - n`` at least the work still
    to come, so the total only falls, and ends equal to the work done."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def phase(self, name: str, total: int, unit: str = "point", *, at_most: bool = False) -> None:
        """Start phase ``name`` of ``total`` units; ``at_most``: the total is an upper bound
        (pruning may take work off it) and the description says so."""
        bar = self.bar
        if bar is None:
            return
        if hasattr(bar, "set_description_str"):
            bar.set_description_str(f"{name} (at most)" if at_most else name, refresh=False)
        if hasattr(bar, "unit"):
            bar.unit = unit
        if hasattr(bar, "reset"):
            bar.reset(total=total)  # n = 0 and the rate (so the ETA) measured afresh
        else:
            bar.n, bar.total = 0, total
            bar.refresh()

    def done(self, n: int = 1) -> None:
        if self.bar is not None and n > 0:
            self.bar.update(n)

    def drop(self, n: int) -> None:
        if self.bar is not None and n > 0:
            self.bar.total -= n
            self.bar.refresh()


def plan_bar(**kwargs: Any) -> Any:
    """A tqdm bar (``kwargs`` as tqdm's) whose ETA is rounded up to the second."""
    from tqdm import tqdm

    class _PlanBar(tqdm):
        @property
        def format_dict(self) -> dict[str, Any]:
            d = dict(super().format_dict)
            d["remaining"] = eta(d["n"], d["total"], d["elapsed"], d["rate"], d["initial"])
            return d

    kwargs.setdefault("bar_format", BAR_FORMAT)
    return _PlanBar(**kwargs)


def eta(n: float, total: float | None, elapsed: float, rate: float | None, initial: float) -> str:
    """The time left as tqdm's clock (MM:SS), rounded up: 00:00 only when nothing is left;
    ``rate``: tqdm's smoothed one, else the mean since the start; '?' before any."""
    if rate is None and elapsed > 0 and n > initial:
        rate = (n - initial) / elapsed
    if total is None or not rate:
        return "?"
    minutes, seconds = divmod(math.ceil(max(total - n, 0) / rate), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"
