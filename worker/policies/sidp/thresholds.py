"""AUTO's batch-size thresholds from measured step times per mode (SiDP §4.3: B_th "derived from
offline profiling" for each GPU and model), and the profile file that carries such times.

Pure arithmetic and JSON, no torch: the router's controller and the benchmark use it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gearshift.worker.errors import InvalidRequestError

# A JSON file of measured decode step times per batch size in each mode, used instead of
# measuring at start-up: {"was_ms": {"1": 12.5, "4": ...}, "cas_ms": {...}}
# (what ``benchmarks/sidp.py`` writes as ``sidp_profile.json``).
PROFILE_ENV = "GEARSHIFT_SIDP_PROFILE"

# Where a group's thresholds came from (the ``sidp_thresholds_source`` figure).
SOURCE_DEFAULT = 0  # the proto's defaults (32/64, the paper's H20 figures)
SOURCE_EXPLICIT = 1  # set in the policy (at start or live)
SOURCE_MEASURED = 2  # timed on the running group at start-up
SOURCE_PROFILE = 3  # read from PROFILE_ENV's file


def thresholds_from_profile(
    was_ms: Mapping[int, float], cas_ms: Mapping[int, float]
) -> tuple[int, int] | None:
    """(cas_enter_batch_size, was_enter_batch_size) from measured decode step times per batch
    size in each mode (§4.3: B_th from offline profiling), or None when CaS is never faster
    (pin ``mode: WAS``).

    B_th is the smallest measured batch from which WaS is at least as fast as CaS at that and
    every larger batch: the group enters CaS below it. WaS comes back at twice B_th, the
    defaults' (32, 64) hysteresis, so a batch hovering around B_th does not flap."""
    batches = sorted(set(was_ms) & set(cas_ms))
    if not any(cas_ms[b] < was_ms[b] for b in batches):
        return None
    b_th = batches[-1] * 2  # CaS wins even at the largest batch measured: above it
    for i in range(len(batches) - 1, -1, -1):
        if cas_ms[batches[i]] < was_ms[batches[i]]:
            break
        b_th = batches[i]
    return b_th, 2 * b_th


@dataclass(frozen=True)
class ModeProfile:
    """Decode step milliseconds per batch size per replica, in each mode."""

    was_ms: dict[int, float]
    cas_ms: dict[int, float]
    source: int  # SOURCE_MEASURED or SOURCE_PROFILE

    @property
    def thresholds(self) -> tuple[int, int] | None:
        return thresholds_from_profile(self.was_ms, self.cas_ms)

    def why(self) -> str:
        """One sentence on what AUTO does with this profile."""
        where = "measured at start-up" if self.source == SOURCE_MEASURED else "from the profile"
        pairs = ", ".join(
            f"B={b}: WaS {self.was_ms[b]:.2f} ms, CaS {self.cas_ms[b]:.2f} ms"
            for b in sorted(self.was_ms)
        )
        found = self.thresholds
        if found is None:
            return f"AUTO pins WaS: CaS was not faster at any batch size {where} ({pairs})"
        return f"AUTO enters CaS below {found[0]}, WaS from {found[1]} ({where}: {pairs})"

    def figures(self) -> dict[str, float]:
        """The profile as policy figures (WorkerStats.policy_stats, docs/metrics.md)."""
        out = {"sidp_thresholds_source": float(self.source)}
        found = self.thresholds
        out["sidp_auto_pins_was"] = 1.0 if found is None else 0.0
        if found is not None:
            out["sidp_cas_enter_batch_size"] = float(found[0])
            out["sidp_was_enter_batch_size"] = float(found[1])
        for b in self.was_ms:
            out[f"sidp_profile_was_ms_b{b}"] = self.was_ms[b]
            out[f"sidp_profile_cas_ms_b{b}"] = self.cas_ms[b]
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "was_ms": {str(b): t for b, t in sorted(self.was_ms.items())},
                "cas_ms": {str(b): t for b, t in sorted(self.cas_ms.items())},
            }
        )


def load_profile(path: str) -> ModeProfile:
    """The profile file ``PROFILE_ENV`` names; refused, naming the variable, when it cannot be
    read or does not give both modes' times at the same positive batch sizes."""

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(PROFILE_ENV, f"{PROFILE_ENV} ({path}): {why}")

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise bad(f"cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict) or set(raw) != {"was_ms", "cas_ms"}:
        raise bad('must be an object with exactly "was_ms" and "cas_ms"')
    parsed: list[dict[int, float]] = []
    for key in ("was_ms", "cas_ms"):
        part = raw[key]
        if not isinstance(part, dict) or not part:
            raise bad(f"{key} must map batch sizes to milliseconds")
        times: dict[int, float] = {}
        for b, t in part.items():
            if not str(b).isdigit() or int(b) < 1:
                raise bad(f"{key}: batch size {b!r} is not a positive integer")
            if (
                isinstance(t, bool)
                or not isinstance(t, int | float)
                or not math.isfinite(t)
                or t <= 0
            ):
                raise bad(f"{key}[{b}]: {t!r} is not a positive number of milliseconds")
            times[int(b)] = float(t)
        parsed.append(times)
    if parsed[0].keys() != parsed[1].keys():
        raise bad("was_ms and cas_ms must give the same batch sizes")
    return ModeProfile(parsed[0], parsed[1], SOURCE_PROFILE)
