"""Links fitted to a profile's measured collectives (issue 30, item 1): each collective's points
[[bytes, seconds], ...] over t ranks, fitted to the α-β form the simulator prices that collective
with (roofline.py), so that the fitted ``Link`` reproduces the measurement when the simulator
prices the same collective on the same group:

- all_reduce (ring): 2(t−1)·α + 2(t−1)/t · bytes / bandwidth;
- all_to_all, all_gather (``bytes`` as collective_timing.py counts them): (t−1)·α + (t−1)/t ·
  bytes / bandwidth;
- send_recv: α + bytes / bandwidth.

Each is ``seconds = x + y · bytes``, fitted by least squares on the relative error (the points
span 4 KiB to 16 MiB, and an absolute fit would ignore the small ones, which pin α), then
α = x / k_α and bandwidth = k_β / y. A negative intercept (α below the noise) is refitted through
zero; a slope that is not positive (times that do not grow with size) gives no link, and the
collective stays priced from the preset. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.operator.sim.calibration import CalibrationProfile, Collective
from gearshift.operator.sim.hardware import Link


@dataclass(frozen=True)
class MeasuredLink:
    """A link fitted to one collective measured over ``ranks`` ranks in ``layout``'s group."""

    collective: str
    ranks: int
    layout: str
    link: Link
    points: int
    mean_rel_error: float  # of the fit over its points

    def to_json(self) -> dict[str, object]:
        return {
            "collective": self.collective,
            "ranks": self.ranks,
            "layout": self.layout,
            "latency_s": self.link.latency,
            "bandwidth_bytes_per_s": self.link.bandwidth,
            "points": self.points,
            "mean_rel_error": round(self.mean_rel_error, 4),
        }


def terms(collective: str, ranks: int) -> tuple[float, float]:
    """(k_α, k_β): the collective's time is k_α·α + k_β·bytes/bandwidth (module docstring)."""
    t = ranks
    if collective == "all_reduce":
        return 2.0 * (t - 1), 2.0 * (t - 1) / t
    if collective in ("all_to_all", "all_gather"):
        return float(t - 1), (t - 1) / t
    if collective == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"no α-β model for collective {collective!r}")


def fit(collective: str, measured: Collective) -> tuple[Link, float] | None:
    """The link that prices ``measured`` as the simulator prices ``collective``, and the fit's
    mean relative error; None when the times do not grow with the size."""
    xs = [b for b, _ in measured.points]
    ys = [s for _, s in measured.points]
    # Relative least squares: minimise Σ((x + y·b − s)/s)², i.e. ordinary least squares on the
    # rows (1/s, b/s) against 1.
    a11 = sum(1 / s**2 for s in ys)
    a12 = sum(b / s**2 for b, s in zip(xs, ys, strict=True))
    a22 = sum(b * b / s**2 for b, s in zip(xs, ys, strict=True))
    r1 = sum(1 / s for s in ys)
    r2 = sum(b / s for b, s in zip(xs, ys, strict=True))
    det = a11 * a22 - a12 * a12
    x, y = ((a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det) if det > 0 else (-1.0, 0.0)
    if x < 0:
        x, y = 0.0, r2 / a22  # through zero: the α term is below what the points resolve
    if y <= 0:
        return None
    k_alpha, k_beta = terms(collective, measured.ranks)
    err = sum(abs(x + y * b - s) / s for b, s in zip(xs, ys, strict=True)) / len(xs)
    return Link(bandwidth=k_beta / y, latency=x / k_alpha), err


def measured_links(profile: CalibrationProfile) -> list[MeasuredLink]:
    """Every fittable collective of every layout of ``profile``."""
    out = []
    for name, lp in profile.layouts.items():
        for collective, measured in lp.collectives.items():
            fitted = fit(collective, measured)
            if fitted is not None:
                link, err = fitted
                out.append(
                    MeasuredLink(collective, measured.ranks, name, link, len(measured.points), err)
                )
    return out
