"""``gearshift plan``'s progress bar (issue 30): each phase's total is the work left as far as it
is known (never less than what remains, and at the end the work done), and the ETA reads 00:00
only when nothing is left. The bar's states are recorded through ``Progress``'s seam: any
tqdm-like object; no timed assertions."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import pytest

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.planning import plan_deployment
from gearshift.operator.sim.progress import eta, plan_bar
from gearshift.operator.sim.traffic import Traffic

MODEL = Path(__file__).parent / "fixtures" / "random_qwen3_3layer_config.json"


class Recorder:
    """A tqdm-like bar that keeps every state it shows: (phase, n, total)."""

    def __init__(self) -> None:
        self.n, self.total, self.desc = 0, None, ""
        self.shown: list[tuple[str, int, int | None]] = []

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        self.shown.append((self.desc, self.n, self.total))

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total
        self.refresh()

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc


def _plan(slo: str | None, **kw: Any) -> tuple[Any, Recorder]:
    traffic = Traffic.from_mapping(
        {"rate": 4, "prompt": {"fixed": 256}, "output": {"fixed": 8}, "requests": 12}
    )
    rec = Recorder()
    report = plan_deployment(
        model_desc.load(MODEL), hardware.load("8xH200"), traffic,
        Goodput.parse(slo) if slo else None, rates=[2, 4, 8], kinds={"static", "shift"},
        progress=rec, **kw,
    )  # fmt: skip
    return report, rec


def _check(rec: Recorder, phases: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per phase its (n, total) states; each is honest about what remains."""
    by: dict[str, list[tuple[int, int]]] = {}
    for desc, n, total in rec.shown:
        assert total is not None and 0 <= n <= total, (desc, n, total)
        by.setdefault(desc, []).append((n, total))
    assert list(by) == phases
    for states in by.values():
        last = states[-1][0]  # the work the phase did
        for n, total in states:
            assert total - n >= last - n  # never less left than what is still to come
        assert states[-1] == (last, last)  # it ends full: its total is the work done
        # The total only falls within a phase (pruning takes work off, none is added).
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(states))
    return by


@pytest.mark.parametrize(
    ("slo", "fallback"),
    [
        ("ttft:60000 tpot:1000", False),  # every candidate meets it
        # The tiny model's TTFT is a fraction of a microsecond: only onex8 meets 1 us, alone;
        # the other four wait for a fallback that its meeting the SLO then takes off the total.
        ("ttft:0.001 tpot:0.001", False),
        ("ttft:0.00001 tpot:0.00001", True),  # none meets 10 ns: the fallback runs
        (None, False),
    ],
)
def test_the_pruned_plans_bar_counts_each_phase_and_ends_at_the_points_simulated(
    slo: str | None, fallback: bool
) -> None:
    report, rec = _plan(slo, prune=True)
    by = _check(rec, ["lower bounds", "simulating (at most)"])
    assert by["lower bounds"][-1] == (len(report.results), len(report.results))
    points = sum(len(r.points) for r in report.results)
    assert by["simulating (at most)"][-1] == (points, points) and points > 0
    # The impossible SLO: every candidate misses it alone, so all of them wait for the fallback,
    # which is on the total from the start (no n/n+1 while points remain).
    missing = [r for r in report.results if r.bound and "miss the SLO" in (r.pruned or "")]
    met = any(r.at_rate_met for r in report.results)
    assert met != fallback or slo is None
    if fallback:
        assert by["simulating (at most)"][0] == (0, len(report.results))
        assert all(len(r.points) <= 1 for r in report.results)
    elif slo is None:  # only the declared rate decides
        assert all(len(r.points) <= 1 for r in report.results)
    elif slo == "ttft:0.001 tpot:0.001":
        assert len(missing) == len(report.results) - 1
        # onex8 met the SLO: the fallback's points leave the total at once, nothing done between.
        states = by["simulating (at most)"]
        assert states[0] == (0, 3 + len(missing))
        assert any(
            a[0] == b[0] and a[1] - b[1] == len(missing) for a, b in itertools.pairwise(states)
        )


def test_the_unpruned_plans_bar_is_every_candidate_at_every_rate() -> None:
    report, rec = _plan(None)
    by = _check(rec, ["simulating"])
    assert by["simulating"][0] == (0, 3 * len(report.results))


def test_the_eta_reads_zero_only_when_nothing_is_left() -> None:
    assert eta(9, 10, 5.4, None, 0) == "00:01"  # 0.6 s left: tqdm's own clock reads 00:00
    assert eta(10, 10, 6.0, None, 0) == "00:00"
    assert eta(0, 10, 0.0, None, 0) == "?"  # no rate yet
    assert eta(0, 7200, 1.0, 1.0, 0) == "2:00:00"
    bar = plan_bar(file=io.StringIO(), total=10, desc="simulating", unit="point")
    bar.n, bar.start_t = 9, bar.start_t - 5.4  # 9 points in 5.4 s: 0.6 s to go
    assert "9/10 [00:05<00:01" in str(bar)
    bar.close()
