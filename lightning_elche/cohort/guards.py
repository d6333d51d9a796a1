"""Convergence guards: the cohort's divergence history in, a verdict on the anchor out.

Every rank runs its own copy of the guard on the same all-reduced :class:`DivergenceReport`, so a
guard is pure Python with plain float arithmetic: the same inputs give the same verdict on every
rank, and it needs nothing but cohort-level numbers, whatever the number of ranks.

A verdict is applied by the controller (``Controller.observe(report, growth_allowed=...)`` and
``Controller.shrink_anchor``): ``"stable"`` lets a proposed anchor growth be committed,
``"suppress"`` holds the anchor, ``"nudge"`` shrinks it now. After any warning a guard keeps
answering ``"suppress"`` until it has seen ``rearm_after`` clean boundaries in a row, so growth
resumes only once the warning has really passed and the controller needs no extra state.

Why these rules and not flodl's (its ``convergence.rs``; docs/how-it-works.md): flodl's trend rule
(``D_t > D_{t-1} > D_{t-2}`` above the threshold) fires on one boundary in six of pure noise
(three rising values in a row), about 55 times per run. Its MSF guard compares a per-step rate
with fixed thresholds; the same growth per window spread over more steps is a smaller rate, so
longer windows push it below them, and flodl found it silent whenever the anchor could relax
upward. Here both guards measure the trace against its own noise with robust statistics (medians
and MADs), require the evidence to persist and the change to be material;
``benchmarks/guard_false_alarms.py`` measures false alarms and detection delays.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional, Protocol, Union, runtime_checkable

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation
REARM_AFTER = 5  # clean boundaries before growth is allowed again (flodl's value)
MIN_NUDGE_FACTOR = 0.1  # combined nudges never cut the anchor below a tenth in one boundary

Action = Literal["stable", "suppress", "nudge"]
ACTIONS = ("stable", "suppress", "nudge")


@dataclass(frozen=True)
class DivergenceReport:
    """What one boundary tells a guard; identical on every rank (guards run replicated)."""

    divergence: float  # cohort divergence D_t: sqrt(work-weighted mean_r ||θ_r − θ̄||²) / ||θ̄||
    steps: int  # k_max: the most optimizer steps any rank ran in the window (>= 0)
    anchor: int  # the anchor that window ran with
    lr: Optional[float] = None  # learning rate of the first param group after the boundary


@dataclass(frozen=True)
class Verdict:
    """A guard's answer for one boundary; ``factor`` only matters for ``"nudge"``."""

    action: Action
    factor: float = 1.0  # for "nudge": shrink the anchor by this factor in (0, 1)
    reason: str = ""  # short human text for logs/TensorBoard

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Verdict action must be one of {ACTIONS}, got {self.action!r}")
        if self.action == "nudge" and not 0.0 < self.factor < 1.0:
            raise ValueError(f"a nudge must shrink the anchor: factor in (0, 1), got {self.factor}")


STABLE = Verdict("stable")


@runtime_checkable
class ConvergenceGuard(Protocol):
    """Anything that turns the boundary's divergence into a verdict and checkpoints its state.

    ``state_dict`` must hold plain ints, floats and lists only: it goes into torch checkpoints
    that are loaded with ``weights_only=True``.
    """

    def observe(self, report: DivergenceReport) -> Verdict: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _usable(report: DivergenceReport) -> bool:
    """A window without steps measured nothing, and a non-finite or zero D has no logarithm."""
    d = report.divergence
    return report.steps > 0 and math.isfinite(d) and d > 0.0


def _median_and_sigma(values: Iterable[float]) -> tuple[float, float]:
    """Median and a noise scale that one outlier (a short epoch-end window, a spike) cannot move."""
    data = list(values)
    median = statistics.median(data)
    return median, MAD_TO_SIGMA * statistics.median(abs(v - median) for v in data)


class NoGuard:
    """Always stable: the control baseline, and the choice for runs that trust the overhead rule."""

    def observe(self, report: DivergenceReport) -> Verdict:
        return STABLE

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class _LatchedGuard:
    """The growth latch shared by the guards that warn.

    A subclass's ``_assess`` returns a warning or None, and keeps ``_streak`` above 0 while it
    is gathering evidence that has not yet sustained a warning; such a reading is not clean and
    does not count towards re-arming. ``warnings`` counts the boundaries on which the guard
    itself raised an alarm (the latch's holds excluded): the figure flodl reported as "fires per
    run", worth logging.
    """

    def __init__(self, threshold: float, window: int, warmup: int, z: float, sustain: int, rearm_after: int) -> None:
        if not (math.isfinite(threshold) and threshold >= 0.0):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
        if not 3 <= warmup <= window:
            raise ValueError(f"need 3 <= warmup <= window, got warmup={warmup}, window={window}")
        if rearm_after < 1:
            raise ValueError(f"rearm_after must be >= 1, got {rearm_after}")
        self.threshold = threshold
        self.warmup = warmup
        self.z = z
        self.sustain = sustain
        self.rearm_after = rearm_after
        self.warnings = 0
        self._clean = rearm_after  # armed from the start
        self._streak = 0

    def observe(self, report: DivergenceReport) -> Verdict:
        if not _usable(report):
            return self._hold_or_stable()  # a missing reading is no evidence either way
        warning = self._assess(report)
        if warning is not None:
            self.warnings += 1
            self._clean = 0
            return warning
        if self._streak == 0:
            self._clean = min(self._clean + 1, self.rearm_after)
        return self._hold_or_stable()

    def _hold_or_stable(self) -> Verdict:
        if self._clean >= self.rearm_after:
            return STABLE
        return Verdict("suppress", reason=f"holding growth: {self._clean}/{self.rearm_after} clean boundaries")

    def _assess(self, report: DivergenceReport) -> Optional[Verdict]:
        raise NotImplementedError

    def _latch_state(self) -> dict[str, Any]:
        return {"clean": self._clean, "warnings": self.warnings}

    def _load_latch_state(self, state: dict[str, Any]) -> None:
        self._clean = min(int(state["clean"]), self.rearm_after)
        self.warnings = int(state["warnings"])


class TrendGuard(_LatchedGuard):
    """Suppress growth while the divergence stands well above its recent level.

    flodl's rule (three rising values, the last above the threshold) fires on one boundary in six
    of pure noise. This one compares ``ln D`` with the median of the last ``window`` readings and fires when, for
    ``sustain`` boundaries in a row, D is above ``threshold`` and the rise exceeds both ``z``
    noise scales and a factor ``1 + min_rise``. The noise scale comes from the MAD of successive
    differences of ``ln D``, which a slow decay or a growth ramp does not inflate (a MAD of the
    levels would, and would then hide the ramp). The minimum rise keeps ordinary wander silent:
    flodl measured steady-state D wandering between 0.025 and 0.04, about +-25 %. Three boundaries
    of evidence (``sustain``) keep slowly wandering, autocorrelated noise under one alarm per 100
    boundaries (0.57 measured; 1.09 with two) for one boundary more of delay.

    It never nudges: a rise in level is no proof that the cadence is too long (flodl's comment:
    trend-only nudging can kill convergence). The median absorbs a lasting step after about
    ``window / 2`` boundaries, so a new steady level stops holding growth.

    ``threshold`` 0.05 is the flodl default: steady-state D sat at 0.025-0.04 on ResNet-20, so
    normal training stays below it and the guard only speaks about unusual divergence.
    """

    DEFAULT_THRESHOLD = 0.05

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        window: int = 24,
        warmup: int = 8,
        z: float = 3.0,
        sustain: int = 3,
        min_rise: float = 0.5,
        rearm_after: int = REARM_AFTER,
    ) -> None:
        super().__init__(threshold, window, warmup, z, sustain, rearm_after)
        self.min_log_rise = math.log1p(min_rise)
        self._history: deque[float] = deque(maxlen=window)

    def _assess(self, report: DivergenceReport) -> Optional[Verdict]:
        log_d = math.log(report.divergence)
        history = list(self._history)
        self._history.append(log_d)
        if len(history) < self.warmup:
            return None
        baseline, _ = _median_and_sigma(history)
        _, diff_sigma = _median_and_sigma(b - a for a, b in zip(history, history[1:]))
        rise = log_d - baseline
        # Differences of independent readings carry twice the variance of the readings.
        bar = max(self.z * diff_sigma / math.sqrt(2.0), self.min_log_rise)
        self._streak = self._streak + 1 if report.divergence > self.threshold and rise > bar else 0
        if self._streak < self.sustain:
            return None
        return Verdict(
            "suppress",
            reason=f"divergence {report.divergence:.3g} is {math.exp(rise):.2f}x its recent median "
            f"for {self._streak} boundaries",
        )

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "streak": self._streak, **self._latch_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history.clear()
        self._history.extend(float(v) for v in state["history"])
        self._streak = int(state["streak"])
        self._load_latch_state(state)


class MsfGuard(_LatchedGuard):
    """Nudge the anchor down while ``ln D`` keeps growing across boundaries; hold it on a jump.

    The rate is flodl's across-event proxy for a transversal Lyapunov exponent,
    ``λ = d ln D / d step``, pooled: the bias-corrected EMA (``alpha``) of the per-boundary
    increments of ``ln D`` over the EMA of the window lengths (growth over steps, as the
    controller pools speeds), so the per-step ratio of a short epoch-end window is not amplified
    by its small step count. flodl compared λ with fixed per-step thresholds, which long windows
    push out of reach; here the decision is scale-free:

    * significant: the EMA of the increments exceeds ``z`` standard errors, the standard error
      coming from the MAD of the last ``window`` increments (for independent noise on a steady
      level the increments telescope, and the EMA's spread is ``sigma * (1 - alpha) /
      sqrt(1 + alpha)`` with ``sigma`` the increments' own);
    * material: at the mean window length, D grows by at least ``min_growth`` per window;
    * above ``threshold``.

    After ``sustain`` such boundaries in a row the guard warns. It suppresses growth, and nudges
    the anchor down by ``nudge_factor`` once D has kept rising since the run of significant
    boundaries began (by ``z`` increment noise scales and by ``min_growth`` per window): an
    EMA also stays up for a while after a single jump, and a jump says the cadence moved D, not
    that D runs away at this cadence. A nudge restarts the run, so a cohort that keeps diverging
    is nudged again later.

    ``threshold`` 0.01 is a fifth of the trend guard's: sustained exponential growth is worth
    acting on before D reaches a worrying level, and the significance test keeps the steady
    state (D about 0.03 in flodl's runs) silent. After the LR decays D falls to 1e-4 and below,
    where the guard stays out of the way.
    """

    DEFAULT_THRESHOLD = 0.01
    NOISE_FLOOR = 1e-3  # ln-D increments below this are rounding, not noise

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        alpha: float = 0.9,
        window: int = 16,
        warmup: int = 8,
        z: float = 3.0,
        sustain: int = 2,
        min_growth: float = 0.05,
        nudge_factor: float = 0.5,
        rearm_after: int = REARM_AFTER,
    ) -> None:
        super().__init__(threshold, window, warmup, z, sustain, rearm_after)
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0.0 < nudge_factor < 1.0:
            raise ValueError(f"nudge_factor must be in (0, 1), got {nudge_factor}")
        self.alpha = alpha
        self.min_log_growth = math.log1p(min_growth)
        self.nudge_factor = nudge_factor
        self._prev_log: Optional[float] = None
        self._weight = 0.0  # sum of alpha**j: dividing by it is the Adam-style bias correction
        self._mean_increment = 0.0
        self._mean_steps = 0.0
        self._increments: deque[float] = deque(maxlen=window)
        self._streak_start = 0.0  # ln D at the first boundary of the current significant run

    @property
    def rate(self) -> float:
        """λ: growth of ln D per optimizer step, bias-corrected EMA (0 before two readings)."""
        return self._mean_increment / self._mean_steps if self._mean_steps > 0 else 0.0

    def _assess(self, report: DivergenceReport) -> Optional[Verdict]:
        log_d = math.log(report.divergence)
        prev, self._prev_log = self._prev_log, log_d
        if prev is None:
            return None
        increment = log_d - prev
        self._weight = self.alpha * self._weight + 1.0
        self._mean_increment += (increment - self._mean_increment) / self._weight
        self._mean_steps += (report.steps - self._mean_steps) / self._weight
        self._increments.append(increment)
        if len(self._increments) < self.warmup:
            return None
        _, sigma = _median_and_sigma(self._increments)
        stderr = max(sigma, self.NOISE_FLOOR) * (1.0 - self.alpha) / math.sqrt(1.0 + self.alpha)
        significant = (
            report.divergence > self.threshold
            and self._mean_increment >= self.min_log_growth  # = rate * mean window length
            and self._mean_increment > self.z * stderr
        )
        self._streak = self._streak + 1 if significant else 0
        if self._streak == 1:
            self._streak_start = log_d
        if self._streak < self.sustain:
            return None
        growth = f"ln D grows {self.rate:.3g}/step ({self._mean_increment / stderr:.1f} standard errors)"
        risen = log_d - self._streak_start
        if risen >= max(self.z * max(sigma, self.NOISE_FLOOR), (self._streak - 1) * self.min_log_growth):
            self._streak = 0
            return Verdict("nudge", self.nudge_factor, reason=f"{growth}, still rising")
        return Verdict("suppress", reason=growth)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prev_log": [] if self._prev_log is None else [self._prev_log],
            "weight": self._weight,
            "mean_increment": self._mean_increment,
            "mean_steps": self._mean_steps,
            "increments": list(self._increments),
            "streak": self._streak,
            "streak_start": self._streak_start,
            **self._latch_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev_log = float(state["prev_log"][0]) if state["prev_log"] else None
        self._weight = float(state["weight"])
        self._mean_increment = float(state["mean_increment"])
        self._mean_steps = float(state["mean_steps"])
        self._increments.clear()
        self._increments.extend(float(v) for v in state["increments"])
        self._streak = int(state["streak"])
        self._streak_start = float(state["streak_start"])
        self._load_latch_state(state)


class LrDropWatcher:
    """Shrink the anchor once when the learning rate falls off a cliff between two boundaries.

    After a sharp drop (a step schedule, ReduceLROnPlateau) the local optimizers re-settle and
    a long cadence averages models that move differently; flodl halves the anchor as a
    precaution. Only a cliff counts: a drop of more than ``drop`` (30 %) after a boundary where
    the LR fell by less than half that. Warm-up increases and the few percent per boundary of a
    cosine or exponential decay stay silent, and so does the tail of a decay toward zero, whose
    drops per boundary grow large but gradually: there the replicas barely move, and halving
    the anchor again and again would only cost throughput. It needs no divergence and holds no
    latch: the guard governs growth afterwards.
    """

    def __init__(self, drop: float = 0.3, factor: float = 0.5) -> None:
        if not 0.0 < drop < 1.0:
            raise ValueError(f"drop must be in (0, 1), got {drop}")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must be in (0, 1), got {factor}")
        self.drop = drop
        self.factor = factor
        self._prev_lr: Optional[float] = None
        self._falling = False  # the LR fell by more than drop / 2 at the previous boundary

    def observe(self, report: DivergenceReport) -> Verdict:
        lr = report.lr
        if lr is None or not math.isfinite(lr) or lr <= 0.0:
            return STABLE
        prev, self._prev_lr = self._prev_lr, float(lr)
        if prev is None:
            return STABLE
        fall = (prev - lr) / prev
        was_falling, self._falling = self._falling, fall > self.drop / 2
        if fall <= self.drop or was_falling:
            return STABLE
        reason = f"learning rate fell {fall:.0%} ({prev:.3g} -> {lr:.3g})"
        return Verdict("nudge", self.factor, reason=reason)

    def state_dict(self) -> dict[str, Any]:
        return {"prev_lr": [] if self._prev_lr is None else [self._prev_lr], "falling": float(self._falling)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev_lr = float(state["prev_lr"][0]) if state["prev_lr"] else None
        self._falling = bool(state.get("falling", 0.0))


def combine(*verdicts: Verdict) -> Verdict:
    """One verdict from several watchers of the same boundary (the guard and the LR watcher).

    Nudges compound (their factors multiply, never below ``MIN_NUDGE_FACTOR``), a nudge also
    stops growth, and any suppress beats stable.
    """
    nudges = [v for v in verdicts if v.action == "nudge"]
    if nudges:
        factor = max(math.prod(v.factor for v in nudges), MIN_NUDGE_FACTOR)
        return Verdict("nudge", factor, reason="; ".join(v.reason for v in nudges if v.reason))
    held = [v for v in verdicts if v.action == "suppress"]
    if held:
        return Verdict("suppress", reason="; ".join(v.reason for v in held if v.reason))
    return STABLE


GUARDS = ("trend", "msf", "none")


def make_guard(guard: Union[str, ConvergenceGuard], divergence_threshold: Optional[float] = None) -> ConvergenceGuard:
    """Build the guard named by ``guard`` ("trend" | "msf" | "none"), or pass an instance through.

    ``divergence_threshold`` is the floor below which the named guard never fires; None takes the
    guard's own default (``TrendGuard.DEFAULT_THRESHOLD`` 0.05, ``MsfGuard.DEFAULT_THRESHOLD``
    0.01). An instance keeps the threshold it was built with.
    """
    if isinstance(guard, str):
        name = guard.strip().lower()
        if name == "none":
            return NoGuard()
        if name == "trend":
            return TrendGuard(TrendGuard.DEFAULT_THRESHOLD if divergence_threshold is None else divergence_threshold)
        if name == "msf":
            return MsfGuard(MsfGuard.DEFAULT_THRESHOLD if divergence_threshold is None else divergence_threshold)
    elif isinstance(guard, ConvergenceGuard):
        return guard
    raise ValueError(
        f"guard must be one of {GUARDS} or an object with observe/state_dict/load_state_dict "
        f"(a ConvergenceGuard), got {guard!r}"
    )
