"""False alarms and detection delays of the convergence guards on synthetic divergence traces.

    .venv/bin/python benchmarks/guard_false_alarms.py      # a few seconds after the import
    .venv/bin/python benchmarks/guard_false_alarms.py --smoke --json /tmp/guards.json   # 2 seeds, short traces

Noise-only traces (10 seeds x 2,000 boundaries each: lognormal noise around D = 0.1, flodl's
training-like decay, autocorrelated wander, short epoch-end windows) give the false-alarm rates:
*alarms* are boundaries on which a guard raised a warning itself, *held* those on which growth was
not allowed (warnings plus the latch's holds until 5 clean boundaries). Growing traces (20 seeds,
40 clean boundaries, then growth or a jump) give the detection delay: boundaries from the onset to
the guard's first own warning at or after it (median/worst; "-" = not caught within 40, counted
as 41 in a median; "msf nudge": to its first nudge). ``flodl`` is flodl's original trend rule,
``D_t > D_{t-1} > D_{t-2}`` and ``D_t > 0.05``, behind the same 5-clean latch.
Seeded and deterministic; no torch needed beyond the package import. Results go to
``benchmarks/results/guard_false_alarms.json``; a trace whose figures fail is recorded as failed
(JSON and table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

if __package__ in (None, ""):  # run as `python benchmarks/guard_false_alarms.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import conclude, results_path
from benchmarks.provenance import Failures, spread
from lightning_elche.cohort.guards import (
    ConvergenceGuard,
    DivergenceReport,
    MsfGuard,
    NoGuard,
    TrendGuard,
    Verdict,
    _LatchedGuard,
)

SMOKE = {"seeds": 2, "boundaries": 100, "delay_seeds": 2}
PRE_ONSET = 40
HORIZON = 40
STEPS = 100  # optimizer steps per window
LEVEL = 0.1  # above both guards' thresholds, so only the statistics keep them quiet

Trace = Callable[[random.Random], Iterator[tuple[float, int]]]


class FlodlTrendRule(_LatchedGuard):
    """flodl 0.5.3's rule, for comparison: three rising readings, the last above the threshold."""

    def __init__(self, threshold: float = 0.05) -> None:
        # the latch alone: the rule reads three values and needs no warm-up, noise scale or streak
        super().__init__(threshold, window=3, warmup=3, z=0.0, sustain=1, rearm_after=5)
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


def false_alarms(make: Callable[[], ConvergenceGuard], trace: Trace, seeds: int, boundaries: int) -> dict[str, float]:
    """Alarms and held boundaries per 100 boundaries, over ``seeds`` traces of ``boundaries`` each."""
    alarms = held = 0
    for seed in range(seeds):
        guard = make()
        verdicts = run(guard, trace(random.Random(seed)), boundaries)
        held += sum(v.action != "stable" for v in verdicts)
        alarms += getattr(guard, "warnings", 0)
    per_100 = 100.0 / (seeds * boundaries)
    return {"alarms": alarms * per_100, "held": held * per_100}


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


def delays(make: Callable[[], ConvergenceGuard], trace: Trace, seeds: int, nudge: bool = False) -> dict[str, float]:
    """The spread of the detection delay over ``seeds`` traces, one not caught within HORIZON counted as
    HORIZON + 1, and how many were caught."""
    found = [first_alarm(make(), trace(random.Random(10_000 + seed)), nudge) for seed in range(seeds)]
    return {**spread([f if f is not None else HORIZON + 1 for f in found]), "caught": sum(f is not None for f in found)}


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, dict[str, Any]]:
    noise = [(f"lognormal sigma {s}", lognormal(s)) for s in (0.0, 0.05, 0.1, 0.2, 0.3)]
    noise += [("training-like decay", training_like), ("AR(1) wander", wandering), ("epoch-end windows", short_windows)]
    cases = []
    for sigma in (0.0, 0.1, 0.3):
        cases += [
            (f"x1.2/boundary, sigma {sigma}", growing(sigma, growth=1.2)),
            (f"x1.05/boundary, sigma {sigma}", growing(sigma, growth=1.05)),
            (f"step x3, sigma {sigma}", growing(sigma, jump=3.0)),
            (f"step x2, sigma {sigma}", growing(sigma, jump=2.0)),
            (f"step x1.4, sigma {sigma}", growing(sigma, jump=1.4)),
        ]
    results: dict[str, dict[str, Any]] = {"false_alarms": {}, "delays": {}}
    for label, trace in noise:
        results["false_alarms"][label] = failures.attempt(
            label, 0, lambda: {name: false_alarms(make, trace, args.seeds, args.boundaries) for name, make in GUARDS.items()}
        )
    for label, trace in cases:
        results["delays"][label] = failures.attempt(label, 0, lambda: {
            **{name: delays(make, trace, args.delay_seeds) for name, make in GUARDS.items()},
            "msf nudge": delays(MsfGuard, trace, args.delay_seeds, nudge=True),
        })  # fmt: skip
    return results


LABELS = {"flodl": "flodl's rule", "none": "no guard", "trend": "TrendGuard", "msf": "MsfGuard", "msf nudge": "MsfGuard's first nudge"}


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``false alarms`` (per 100 boundaries, and the boundaries held when the latch holds more),
    ``detection delay`` (median/worst boundaries from the onset, '-' not caught within 40), and the
    README's ``summary`` of both."""
    results, args = record["results"], record["args"]

    def alarms(cell: dict[str, float]) -> str:
        shown = f"{cell['alarms']:.3g}"
        return shown if cell["held"] == cell["alarms"] else f"{shown} ({cell['held']:.3g} held)"

    def delay(cell: dict[str, float]) -> str:
        if cell["caught"] == 0:
            return "-"
        return f"{cell['median']:g}/{cell['max']:g}" if cell["caught"] == cell["n"] else f"{cell['median']:g}/-"

    out = {}
    for name, key, render, columns, heading in (
        ("false alarms", "false_alarms", alarms, list(GUARDS),
         f"noise-only trace ({args['seeds']} seeds x {args['boundaries']} boundaries)"),
        ("detection delay", "delays", delay, [*GUARDS, "msf nudge"], f"growing trace ({args['delay_seeds']} seeds)"),
    ):
        lines = [f"| {heading} | " + " | ".join(LABELS[c] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for label, row in results[key].items():
            cells = ["failed"] * len(columns) if row is None else [render(row[c]) for c in columns]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        out[name] = "\n".join(lines) + "\n"
    lines = ["| trace | " + " | ".join(LABELS[c] for c in SUMMARY_COLUMNS) + " |", "|---" * (len(SUMMARY_COLUMNS) + 1) + "|"]
    for label, key, trace in SUMMARY_ROWS:
        row = results[key].get(trace)
        render = alarms if key == "false_alarms" else delay
        lines.append(f"| {label} | " + " | ".join("failed" if row is None else render(row[c]) for c in SUMMARY_COLUMNS) + " |")
    out["summary"] = "\n".join(lines) + "\n"
    return out


# the README's table: a few traces of each kind, the guards beside flodl's rule
SUMMARY_COLUMNS = ("flodl", "trend", "msf")
SUMMARY_ROWS = (
    ("lognormal noise, sigma 0.1", "false_alarms", "lognormal sigma 0.1"),
    ("lognormal noise, sigma 0.3", "false_alarms", "lognormal sigma 0.3"),
    ("training-like decay", "false_alarms", "training-like decay"),
    ("slowly wandering AR(1) noise", "false_alarms", "AR(1) wander"),
    ("detection, D x1.2 per boundary, sigma 0.1", "delays", "x1.2/boundary, sigma 0.1"),
    ("detection, D jumps x3, sigma 0.1", "delays", "step x3, sigma 0.1"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="noise-only traces per guard and trace kind")
    parser.add_argument("--boundaries", type=int, default=2000, help="boundaries per noise-only trace")
    parser.add_argument("--delay-seeds", type=int, default=20, help="growing traces per guard and case")
    parser.add_argument("--smoke", action="store_true", help="2 seeds of 100 boundaries: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/guard_false_alarms.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("guard_false_alarms", args)
    failures = Failures()
    conclude("guard_false_alarms", args, measure(args, failures), failures, tables)


if __name__ == "__main__":
    main()
