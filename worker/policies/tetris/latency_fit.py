"""Least-squares fit of Tetris's prefill latency model, Eq. (1): T_s = a + b·L + c·(C·L) + d·L²
(§5.1: fitted per SP size from latency measured across (C, L) pairs).

Torch-free: the router's planner (``operator/planner/latency_model.py``) and the group's own
start-up fit (``launch/tetris/autofit.py``) share it.
"""

from __future__ import annotations

from collections.abc import Iterable


def fit_eq1(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float, float, float]:
    """(a, b, c, d) of Eq. (1) from (C, L, seconds) samples; ValueError when they cannot
    determine it (fewer than 4, or C and L not both varied)."""
    import numpy as np

    rows = [
        (1.0, length, history * length, length * length, secs) for history, length, secs in samples
    ]
    if len(rows) < 4:
        raise ValueError(f"fitting Eq. (1) needs at least 4 samples, got {len(rows)}")
    data = np.asarray(rows, dtype=np.float64)
    x, y = data[:, :4], data[:, 4]
    if np.linalg.matrix_rank(x) < 4:
        raise ValueError("the samples do not determine Eq. (1): vary both C and L")
    # Columns differ by orders of magnitude (1 vs L²); scale them so lstsq is well conditioned.
    norms = np.linalg.norm(x, axis=0)
    coef, *_ = np.linalg.lstsq(x / norms, y, rcond=None)
    a, b, c, d = (float(v) for v in coef / norms)
    return a, b, c, d


def relative_rms(
    coeffs: tuple[float, float, float, float], samples: Iterable[tuple[float, float, float]]
) -> float:
    """The fit's relative RMS error on ``samples`` (those with positive seconds)."""
    a, b, c, d = coeffs
    errors = [(a + n * (b + c * h + d * n) - s) / s for h, n, s in samples if s > 0]
    return (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else 0.0
