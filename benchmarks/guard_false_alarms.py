"""False alarms and detection delays of the convergence guards on synthetic divergence traces.

    .venv/bin/python benchmarks/guard_false_alarms.py      # a few seconds after the import

Noise-only traces (10 seeds x 2,000 boundaries each: lognormal noise around D = 0.1, flodl's
training-like decay, autocorrelated wander, short epoch-end windows) give the false-alarm rates:
*alarms* are boundaries on which a guard raised a warning itself, *held* those on which growth was
not allowed (warnings plus the latch's holds until 5 clean boundaries). Growing traces (20 seeds,
40 clean boundaries, then growth or a jump) give the detection delay: boundaries from the onset to
the guard's first own warning at or after it (median/worst; "-" = not caught within 40, counted
as 41 in a median; "msf nudge": to its first nudge). ``flodl`` is flodl's original trend rule,
``D_t > D_{t-1} > D_{t-2}`` and ``D_t > 0.05``, behind the same 5-clean latch.
Seeded and deterministic; no torch needed beyond the package import.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Iterator, Optional

from lightning_elche.cohort.guards import (
    ConvergenceGuard,
    DivergenceReport,
    MsfGuard,
    NoGuard,
    TrendGuard,
    Verdict,
    _LatchedGuard,
)

SEEDS = 10
BOUNDARIES = 2000
DELAY_SEEDS = 20
PRE_ONSET = 40
HORIZON = 40
STEPS = 100  # optimizer steps per window
LEVEL = 0.1  # above both guards' thresholds, so only the statistics keep them quiet

Trace = Callable[[random.Random], Iterator[tuple[float, int]]]


class FlodlTrendRule(_LatchedGuard):
    """flodl 0.5.3's rule, for comparison: three rising readings, the last above the threshold."""

    def __init__(self, threshold: float = 0.05) -> None:
        super().__init__(rearm_after=5)
        self.threshold = threshold
        self._last: list[float] = []

    def _assess(self, report: DivergenceReport) -> Optional[Verdict]:
        self._last = (self._last + [report.divergence])[-3:]
        if len(self._last) == 3 and self._last[2] > self._last[1] > self._last[0] and self._last[2] > self.threshold:
            return Verdict("suppress", reason="three rises")
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


GUARDS: dict[str, Callable[[], ConvergenceGuard]] = {
    "flodl": FlodlTrendRule,
    "none": NoGuard,
    "trend": TrendGuard,
    "msf": MsfGuard,
}


def lognormal(sigma: float, level: float = LEVEL) -> Trace:
    def trace(rng: random.Random) -> Iterator[tuple[float, int]]:
        while True:
            yield level * math.exp(rng.gauss(0.0, sigma)), STEPS

    return trace


def training_like(rng: random.Random) -> Iterator[tuple[float, int]]:
    """flodl's ResNet-20 shape: D from 0.12 down to 0.03 over 30 boundaries, then flat, sigma 0.15."""
    t = 0
    while True:
        level = 0.12 * (0.03 / 0.12) ** min(t / 30, 1.0)
        yield level * math.exp(rng.gauss(0.0, 0.15)), STEPS
        t += 1


def wandering(rng: random.Random) -> Iterator[tuple[float, int]]:
    """Autocorrelated noise, AR(1) with rho 0.8 and marginal sigma 0.2: slow wander, no trend."""
    e = 0.0
    while True:
        e = 0.8 * e + 0.6 * rng.gauss(0.0, 0.2)
        yield LEVEL * math.exp(e), STEPS


def short_windows(rng: random.Random) -> Iterator[tuple[float, int]]:
    """Every 10th window is an epoch-end remainder of 30 steps, with D smaller by sqrt(0.3)."""
    t = 0
    while True:
        steps = 30 if t % 10 == 9 else STEPS
        yield LEVEL * math.sqrt(steps / STEPS) * math.exp(rng.gauss(0.0, 0.1)), steps
        t += 1


def run(guard: ConvergenceGuard, trace: Iterator[tuple[float, int]], n: int) -> list[Verdict]:
    return [guard.observe(DivergenceReport(d, k, anchor=STEPS)) for d, k in (next(trace) for _ in range(n))]


def false_alarms(make: Callable[[], ConvergenceGuard], trace: Trace) -> tuple[float, float]:
    alarms = held = 0
    for seed in range(SEEDS):
        guard = make()
        verdicts = run(guard, trace(random.Random(seed)), BOUNDARIES)
        held += sum(v.action != "stable" for v in verdicts)
        alarms += getattr(guard, "warnings", 0)
    per_100 = 100.0 / (SEEDS * BOUNDARIES)
    return alarms * per_100, held * per_100


def growing(sigma: float, growth: float = 1.0, jump: float = 1.0) -> Trace:
    """Stable at LEVEL for PRE_ONSET boundaries, then a ``jump`` and ``growth`` per boundary."""

    def trace(rng: random.Random) -> Iterator[tuple[float, int]]:
        for t in range(-PRE_ONSET + 1, HORIZON + 1):
            level = LEVEL if t <= 0 else LEVEL * jump * growth**t
            yield level * math.exp(rng.gauss(0.0, sigma)), STEPS

    return trace


def first_alarm(guard: ConvergenceGuard, trace: Iterator[tuple[float, int]], nudge: bool) -> Optional[int]:
    """Boundaries from the onset to the guard's own first warning (or nudge) at or after it.

    Counting the guard's warnings, not its verdicts, keeps a latch still holding from a false
    alarm before the onset from passing for a detection.
    """
    for t in range(-PRE_ONSET + 1, HORIZON + 1):
        before = getattr(guard, "warnings", 0)
        d, k = next(trace)
        verdict = guard.observe(DivergenceReport(d, k, anchor=STEPS))
        alarm = verdict.action == "nudge" if nudge else getattr(guard, "warnings", 0) > before
        if t >= 1 and alarm:
            return t
    return None


def delays(make: Callable[[], ConvergenceGuard], trace: Trace, nudge: bool = False) -> str:
    found = [first_alarm(make(), trace(random.Random(10_000 + seed)), nudge) for seed in range(DELAY_SEEDS)]
    if all(f is None for f in found):
        return "-"
    caught = [f for f in found if f is not None]
    worst = "-" if len(caught) < len(found) else str(max(caught))
    return f"{statistics.median(f if f is not None else HORIZON + 1 for f in found):g}/{worst}"


def main() -> None:
    names = list(GUARDS)
    noise = [(f"lognormal sigma {s}", lognormal(s)) for s in (0.0, 0.05, 0.1, 0.2, 0.3)]
    noise += [("training-like decay", training_like), ("AR(1) wander", wandering), ("epoch-end windows", short_windows)]
    print(f"False alarms per 100 boundaries ({SEEDS} seeds x {BOUNDARIES} boundaries), alarms | held")
    print(f"{'trace':<24}" + "".join(f"{n:>16}" for n in names))
    for label, trace in noise:
        cells = (false_alarms(GUARDS[n], trace) for n in names)
        print(f"{label:<24}" + "".join(f"{a:>7.3f} |{h:>7.3f}" for a, h in cells))

    print(f"\nDetection delay in boundaries, median/worst over {DELAY_SEEDS} seeds ('-': not caught in {HORIZON})")
    cases = []
    for sigma in (0.0, 0.1, 0.3):
        cases += [
            (f"x1.2/boundary, sigma {sigma}", growing(sigma, growth=1.2)),
            (f"x1.05/boundary, sigma {sigma}", growing(sigma, growth=1.05)),
            (f"step x3, sigma {sigma}", growing(sigma, jump=3.0)),
            (f"step x2, sigma {sigma}", growing(sigma, jump=2.0)),
            (f"step x1.4, sigma {sigma}", growing(sigma, jump=1.4)),
        ]
    columns = [*names, "msf nudge"]
    print(f"{'trace':<28}" + "".join(f"{c:>11}" for c in columns))
    for label, trace in cases:
        cells = [delays(GUARDS[n], trace) for n in names] + [delays(MsfGuard, trace, nudge=True)]
        print(f"{label:<28}" + "".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
