"""The ElChe controller: per-rank speeds in, the next window's per-rank step counts out.

Pure Python on purpose. Every rank runs its own copy on the same all-reduced numbers and must reach
the same decision bit for bit (DESIGN.md section 4), so nothing here touches torch.distributed,
clocks or randomness, and all arithmetic is plain float64/int. The cohort simulator reuses this
class unchanged, which is what makes its predictions worth anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_elche.cohort.link import link_ms

# Defaults carried over from flodl's newer ElChe (its `ElCheConfig`); docs/configuration.md lists them.
SPEED_WINDOW = 5  # windows pooled per speed estimate (the "trust window")
DEAD_ZONE = 0.05  # relative change a count must exceed before it is applied
COHORT_BAND = 0.15  # ranks within 15 % of the slowest form the slow cohort
DOMINANCE_MARGIN = 0.10  # a challenger must be 10 % slower to unseat the anchor rank
MAX_SPEED_RATIO = 64.0
GROWTH_STEP_CAP = 2.0  # the anchor at most doubles per boundary
MISSES_BEFORE_RESET = 5  # windows without a usable reading before a rank's speed is forgotten
STABLE_AFTER = 5  # calibrated windows before the overhead target applies at full strength
WARMUP_TARGET_FACTOR = 2.0  # during warm-up, growth fires only above twice the target

POLICIES = ("sync", "cadence", "async")


@dataclass(frozen=True)
class WindowReport:
    """What every rank measured in the window that just closed, as seen after the all-reduce.

    ``window_ms[r]`` is rank r's time spent training (data and compute, no waiting);
    ``steps[r]`` its real optimizer steps; ``boundary_ms[r]`` the duration of rank r's previous
    boundary (pack, all-reduce, unpack), which includes the time it waited for slower ranks.
    """

    window_ms: Sequence[float]
    steps: Sequence[int]
    boundary_ms: Sequence[float]


@dataclass
class ControllerConfig:
    world_size: int
    policy: str = "cadence"
    anchor: int = 10
    min_anchor: Optional[int] = None
    max_anchor: int = 1000
    overhead_target: float = 0.05
    max_batch_diff: Optional[int] = None
    partition_ratios: Optional[Sequence[float]] = None
    amortize_waits: bool = False  # count waiting at boundaries as overhead (dynamic dispatch; see _tune_anchor)
    # The link, when known, sizes the anchor before any boundary has been measured (see _tune_anchor):
    boundary_bytes: int = 0  # payload one boundary all-reduces (compressed when the averager compresses)
    link_mbit_s: Optional[float] = None  # bandwidth of the slowest link between ranks; None: unknown
    link_latency_ms: float = 0.0  # fixed cost of one reduce on that link

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.boundary_bytes < 0:
            raise ValueError(f"boundary_bytes must be >= 0, got {self.boundary_bytes}")
        if self.link_mbit_s is not None and not (math.isfinite(self.link_mbit_s) and self.link_mbit_s > 0):
            raise ValueError(f"link_mbit_s must be a positive number or None (unknown), got {self.link_mbit_s!r}")
        if not (math.isfinite(self.link_latency_ms) and self.link_latency_ms >= 0):
            raise ValueError(f"link_latency_ms must be a number >= 0, got {self.link_latency_ms!r}")
        if self.min_anchor is None:
            self.min_anchor = self.anchor
        problem = partition_ratios_problem(self.partition_ratios, self.world_size)
        if problem is not None:
            raise ValueError(problem)


def partition_ratios_problem(partition_ratios: Optional[Sequence[float]], world_size: int) -> Optional[str]:
    """Why ``partition_ratios`` cannot serve ``world_size`` ranks, or None when it can."""
    if partition_ratios is None or len(partition_ratios) == world_size:
        return None
    return (
        f"`partition_ratios` has {len(partition_ratios)} entries for {world_size} ranks; give one ratio per rank"
    )


@dataclass
class Controller:
    """Replicated per-window planner: speeds, slow-rank election, counts and anchor tuning.

    Call :meth:`observe` once per boundary with the cohort's :class:`WindowReport`; read
    :attr:`counts` for the steps each rank runs in the next window. The anchor (steps per window
    of the slowest rank) only grows from the overhead rule; :meth:`shrink_anchor` is the seam the
    convergence guards use to tighten it.
    """

    config: ControllerConfig
    anchor: int = field(init=False)
    counts: list[int] = field(init=False)
    anchor_rank: Optional[int] = field(init=False, default=None)
    calibrations: int = field(init=False, default=0)
    windows_seen: int = field(init=False, default=0)
    overhead: float = field(init=False, default=0.0)
    proposed_anchor: Optional[int] = field(init=False, default=None)
    max_total_steps: Optional[int] = field(init=False, default=None)
    # a new generation of an elastic cohort (``controller_state_for``): its anchor grows once it is stable
    settling: bool = field(init=False, default=False)
    # the count and speed readings of members lost since, for the joiners that replace them (``controller_state_for``)
    _vacated: list[dict[str, Any]] = field(init=False, repr=False, default_factory=list)
    _speeds: list[deque[tuple[float, int]]] = field(init=False, repr=False)
    _misses: list[int] = field(init=False, repr=False)
    _inherited: set[int] = field(init=False, repr=False, default_factory=set)  # ranks whose readings are a lost member's

    def __post_init__(self) -> None:
        cfg = self.config
        world = cfg.world_size
        self.anchor = 1 if cfg.policy == "sync" else cfg.anchor
        self._speeds = [deque(maxlen=SPEED_WINDOW) for _ in range(world)]
        self._misses = [0] * world
        if cfg.partition_ratios is not None:
            ratios = list(cfg.partition_ratios)
            self.anchor_rank = min(range(world), key=lambda r: (ratios[r], r))
            self.counts = self._counts_from_ratios(ratios)
        else:
            # Probe with one-step windows until every rank has a speed reading: a long first
            # window at equal shares would idle the fast ranks for its whole length.
            self.counts = [1] * world

    # ------------------------------------------------------------------ speeds

    @property
    def ms_per_step(self) -> list[Optional[float]]:
        """Wall ms per optimizer step per rank over the last windows; None while a rank has no reading.

        Pooled (total ms / total steps), not a mean of per-window ratios, so a long window weighs
        more than a one-step probe whose single step carries all of the window's noise.
        """
        return [sum(ms for ms, _ in ring) / sum(n for _, n in ring) if ring else None for ring in self._speeds]

    @property
    def window_ms(self) -> Optional[float]:
        """How long a window lasts: the anchor's steps on the anchor rank (None before calibration)."""
        if self.anchor_rank is None:
            return None
        ms = self.ms_per_step[self.anchor_rank]
        return None if ms is None else self.anchor * ms

    @property
    def calibrated(self) -> bool:
        return all(ring for ring in self._speeds)

    @property
    def shares(self) -> list[float]:
        """Fraction of the samples each rank receives in the next window."""
        total = sum(self.counts)
        return [c / total for c in self.counts]

    def _record_speeds(self, report: WindowReport) -> None:
        for rank, (ms, steps) in enumerate(zip(report.window_ms, report.steps)):
            if steps > 0 and ms > 0 and math.isfinite(ms):
                if rank in self._inherited:  # its own first reading replaces the lost member's
                    self._inherited.discard(rank)
                    self._speeds[rank].clear()
                self._speeds[rank].append((float(ms), int(steps)))
                self._misses[rank] = 0
            else:
                self._misses[rank] += 1
                if self._misses[rank] >= MISSES_BEFORE_RESET:
                    self._speeds[rank].clear()

    def _elect_anchor_rank(self, ms: list[float]) -> int:
        slowest = max(ms)
        cohort = [r for r, m in enumerate(ms) if m >= (1.0 - COHORT_BAND) * slowest]
        current = self.anchor_rank
        if current is not None and current in cohort:
            challenger = max(cohort, key=lambda r: (ms[r], -r))
            if ms[challenger] > (1.0 + DOMINANCE_MARGIN) * ms[current]:
                return challenger
            return current
        return max(cohort, key=lambda r: (ms[r], -r))

    # ------------------------------------------------------------------ plan

    def observe(self, report: WindowReport, *, growth_allowed: bool = True) -> None:
        """Fold one closed window into the estimates and decide the next window's counts.

        ``growth_allowed`` is the convergence guard's verdict: a proposed anchor growth is only
        committed when it is True.
        """
        cfg = self.config
        if len(report.window_ms) != cfg.world_size or len(report.steps) != cfg.world_size:
            raise ValueError("WindowReport must carry one entry per rank")
        self.windows_seen += 1
        if self.windows_seen > 1:  # the fit's first window carries start-up costs, not speed
            self._record_speeds(report)
        if cfg.policy == "sync":
            return
        if not self.calibrated:
            return
        ms = [m for m in self.ms_per_step if m is not None]
        self.calibrations += 1
        if cfg.partition_ratios is None:
            self.anchor_rank = self._elect_anchor_rank(ms)
        self._tune_anchor(ms, report, growth_allowed)
        self._recompute_counts(ms)

    @property
    def predicted_boundary_ms(self) -> Optional[float]:
        """What a boundary's reduce costs on the configured link; None when the link is unknown.

        The cost is :func:`~lightning_elche.cohort.link.link_ms` of the payload, known only when
        both the link's bandwidth and the payload are: the strategy sets the payload from its
        averager, the bandwidth comes from the user or the simulated link.
        """
        cfg = self.config
        if cfg.link_mbit_s is None or cfg.boundary_bytes <= 0:
            return None
        return link_ms(cfg.boundary_bytes, cfg.world_size, cfg.link_mbit_s, cfg.link_latency_ms)

    def _tune_anchor(self, ms: list[float], report: WindowReport, growth_allowed: bool) -> None:
        """Grow the anchor until the boundary costs at most ``overhead_target`` of a window.

        The boundary cost is the cheapest rank's boundary time: the last rank to arrive waits for
        nobody, so its boundary time is the pure pack/all-reduce/unpack cost the cohort pays. Under
        dynamic dispatch (``amortize_waits``) it is the longest one instead: there a fast rank waits
        for the last step in flight, or a slow one for the fast ones to drain the pool's last
        tickets, under a step whatever the window, which a longer window amortizes like the
        all-reduce, so no rank idles more than the target (under planned dispatch waits come from
        shares, which the window's length does not fix).

        Measured readings are distrusted at first (the first carries warm-up costs, and growth is
        capped per boundary), which on a slow link leaves many short windows each paying the full
        reduce. When the link is known, its predicted cost is therefore a floor for the boundary
        cost, and during warm-up the anchor jumps straight to the one that meets the target at that
        cost; measured readings then take over as without a link.
        """
        cfg = self.config
        assert self.anchor_rank is not None
        predicted = self.predicted_boundary_ms
        positive = [b for b in report.boundary_ms if b > 0 and math.isfinite(b)]
        if not positive and predicted is None:
            return
        measured = (max(positive) if cfg.amortize_waits else min(positive)) if positive else 0.0
        fixed = measured if predicted is None else max(measured, predicted)
        slow_ms = ms[self.anchor_rank]
        window = self.anchor * slow_ms
        self.overhead = fixed / (window + fixed)
        link_sized = None
        if predicted is not None and self.calibrations < STABLE_AFTER:
            link_sized = self._anchor_meeting_target(predicted, slow_ms)
        if self.calibrations < 2 and link_sized is None:
            return  # the first reading includes warm-up costs; never grow on it
        if self.settling and self.calibrations < STABLE_AFTER:
            return  # a new generation's start-up, not its boundary's cost (``controller_state_for``)
        fire_at = cfg.overhead_target
        if self.calibrations < STABLE_AFTER:
            fire_at *= WARMUP_TARGET_FACTOR
        self.proposed_anchor = None
        if self._window_cap_binding():
            return
        candidates = [] if link_sized is None else [link_sized]
        if self.calibrations >= 2 and self.overhead > fire_at:
            scale = min(self.overhead / cfg.overhead_target, GROWTH_STEP_CAP)
            candidates.append(math.ceil(self.anchor * scale))
        if candidates:
            grown = min(max(max(candidates), cfg.min_anchor or 1), cfg.max_anchor)
            if grown > self.anchor:
                self.proposed_anchor = grown
        if self.proposed_anchor is not None and growth_allowed:
            self.anchor = self.proposed_anchor
            self.proposed_anchor = None

    def _anchor_meeting_target(self, boundary_ms: float, slow_ms_per_step: float) -> int:
        """The fewest anchor steps whose window makes ``boundary_ms`` at most ``overhead_target`` of it.

        From ``boundary / (anchor * ms + boundary) <= target``: ``anchor >= boundary * (1 - target)
        / (target * ms)``.
        """
        target = self.config.overhead_target
        return math.ceil(boundary_ms * (1.0 - target) / (target * slow_ms_per_step))

    def shrink_anchor(self, factor: float) -> None:
        """Tighten the cadence (guards, LR drops); may go below ``min_anchor``, never below 1."""
        if not 0.0 < factor < 1.0:
            raise ValueError(f"shrink factor must be in (0, 1), got {factor}")
        self.anchor = max(1, math.floor(self.anchor * factor))
        self.proposed_anchor = None
        ms = self.ms_per_step
        if self.config.policy != "sync" and all(m is not None for m in ms):
            self._recompute_counts([m for m in ms if m is not None], force=True)
        elif self.config.partition_ratios is not None:
            self.counts = self._counts_from_ratios(list(self.config.partition_ratios))
        else:
            self.counts = [self.anchor] * self.config.world_size

    def set_max_total_steps(self, max_total_steps: Optional[int]) -> None:
        """Cap the cohort's steps per window (a window never spans more than one epoch)."""
        if max_total_steps is not None and max_total_steps < self.config.world_size:
            max_total_steps = self.config.world_size
        self.max_total_steps = max_total_steps
        self.counts = self._apply_window_cap(self.counts)

    def _window_cap_binding(self) -> bool:
        return self.max_total_steps is not None and sum(self.counts) >= self.max_total_steps

    def _counts_from_ratios(self, ratios: list[float]) -> list[int]:
        smallest = min(ratios)
        counts = [max(1, round(self.anchor * min(r / smallest, MAX_SPEED_RATIO))) for r in ratios]
        return self._apply_window_cap(self._apply_batch_diff(counts))

    def _recompute_counts(self, ms: list[float], force: bool = False) -> None:
        cfg = self.config
        if cfg.partition_ratios is not None:
            self.counts = self._counts_from_ratios(list(cfg.partition_ratios))
            return
        assert self.anchor_rank is not None
        slow_ms = ms[self.anchor_rank]
        targets = []
        for rank, m in enumerate(ms):
            ratio = min(slow_ms / m, MAX_SPEED_RATIO) if m > 0 else 1.0
            target = max(1, round(self.anchor * ratio))
            current = self.counts[rank]
            keep = not force and self.calibrations > 1 and abs(target - current) <= DEAD_ZONE * current
            targets.append(current if keep else target)
        self.counts = self._apply_window_cap(self._apply_batch_diff(targets))

    def _apply_batch_diff(self, counts: list[int]) -> list[int]:
        limit = self.config.max_batch_diff
        if limit is None:
            return counts
        floor = min(counts)
        return [min(c, floor + limit) for c in counts]

    def _apply_window_cap(self, counts: list[int]) -> list[int]:
        cap = self.max_total_steps
        if cap is None or sum(counts) <= cap:
            return list(counts)
        return split_by_weights(cap, counts, minimum=1)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "anchor": self.anchor,
            "counts": list(self.counts),
            "anchor_rank": -1 if self.anchor_rank is None else self.anchor_rank,
            "calibrations": self.calibrations,
            "speeds": [[list(reading) for reading in ring] for ring in self._speeds],
            "settling": self.settling and self.calibrations < STABLE_AFTER,
            "vacated": list(self._vacated),
            "inherited": sorted(self._inherited),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved controller; a different world size keeps the anchor and re-learns speeds."""
        cfg = self.config
        if cfg.policy == "sync":
            return  # one-step windows whatever the checkpoint held
        self.anchor = int(state["anchor"])
        self.settling = bool(state.get("settling", False))  # absent from earlier checkpoints
        if len(state["counts"]) == cfg.world_size:
            self.counts = [int(c) for c in state["counts"]]
            self.anchor_rank = None if state["anchor_rank"] < 0 else int(state["anchor_rank"])
            self.calibrations = int(state["calibrations"])
            for ring, values in zip(self._speeds, state["speeds"]):
                ring.clear()
                ring.extend((float(ms), int(steps)) for ms, steps in values)
            self._vacated = list(state.get("vacated", []))  # absent from earlier checkpoints
            self._inherited = set(state.get("inherited", []))
        else:
            self.counts = [1] * cfg.world_size  # other ranks, other speeds: probe again
        if cfg.partition_ratios is not None:
            self.counts = self._counts_from_ratios(list(cfg.partition_ratios))
        self.counts = self._apply_window_cap(self.counts)


def split_by_weights(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """Split ``total`` into integer parts proportional to ``weights``, each at least ``minimum``.

    Largest remainder first; parts below ``minimum`` are then topped up from the largest parts.
    Ties go to the lower rank so that every rank computes the same split.
    """
    n = len(weights)
    if n == 0:
        raise ValueError("weights must not be empty")
    if total < minimum * n:
        raise ValueError(f"cannot give {n} parts at least {minimum} each out of {total}")
    weight_sum = float(sum(weights))
    if weight_sum <= 0:
        weights = [1.0] * n
        weight_sum = float(n)
    exact = [total * w / weight_sum for w in weights]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda r: (-(exact[r] - parts[r]), r))
    for rank in order[: total - sum(parts)]:
        parts[rank] += 1
    for rank in range(n):
        while parts[rank] < minimum:
            donor = max(range(n), key=lambda r: (parts[r], -r))
            parts[donor] -= 1
            parts[rank] += 1
    return parts


def controller_state_for(state: dict[str, Any], sources: Sequence[Optional[int]]) -> dict[str, Any]:
    """A controller state of the old generation for the new one, whose rank r was rank ``sources[r]``
    (None: it joined): the members' counts and speed readings carry over.

    A joiner takes the count and readings of a member lost before it (``vacated``, oldest first): a
    joiner after a loss is most likely its replacement on the same device (a spare that took its place,
    the process a launcher restarted), and starts with a window of the lost member's length instead of
    one-step probe windows, in which it idled for two windows while the members trained theirs (the
    first window of a generation is not read as speed). Its own first reading replaces the inherited
    ones; a joiner with no loss before it probes.

    The anchor the old generation tuned carries over, and does not grow until the new generation is
    stable (``STABLE_AFTER`` calibrations): its first boundaries carry its start-up (a new process
    group's first collectives, a joiner's first steps, which the members wait for), not the boundary's
    cost. Read as that cost, they doubled the anchor at every admission: at a kill every 15 s windows
    grew from 0.5 s to 13 s, so each kill cost a window of a member's work and each spare waited a
    window to come in (``benchmarks/elastic_goodput.py``)."""
    anchor_rank = state["anchor_rank"]
    seats = [{"count": c, "speeds": s} for r, (c, s) in enumerate(zip(state["counts"], state["speeds"])) if r not in sources]
    vacated = (list(state.get("vacated", [])) + seats)[-max(len(sources), len(seats), 1):]  # the latest, a world's worth
    counts, speeds, inherited = [], [], []
    for rank, source in enumerate(sources):
        if source is not None:
            seat = {"count": state["counts"][source], "speeds": state["speeds"][source]}
        else:
            seat = vacated.pop(0) if vacated else {"count": 1, "speeds": []}
            if seat["speeds"]:
                inherited.append(rank)
            else:  # nobody lost before it, or a lost member still probing: it probes
                seat = {"count": 1, "speeds": []}
        counts.append(seat["count"])
        speeds.append(seat["speeds"])
    return {
        **state,
        "calibrations": 0, "settling": True,
        "counts": counts,
        "speeds": speeds,
        "anchor_rank": sources.index(anchor_rank) if anchor_rank in sources else -1,
        "vacated": vacated,
        "inherited": inherited + [sources.index(r) for r in state.get("inherited", []) if r in sources],
    }
