"""The cohort's settings, validated once, before anything is built.

Every error names the ``ElCheStrategy`` argument, what it allows and, where there is one, the
setting to use instead, so a bad YAML value fails when the strategy is constructed rather than an
hour into a job. The controller, the guard and the averaging weights are then built from this one
object (``controller_config``, ``make_guard``), so no argument is checked twice.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Optional, Sequence, Union

from lightning_elche.cohort.controller import POLICIES, ControllerConfig
from lightning_elche.cohort.guards import ConvergenceGuard, make_guard
from lightning_elche.cohort.records import SCALAR_REDUCTIONS

DEFAULT_CADENCE_ANCHOR = 10
DISPATCHES = ("auto", "planned", "dynamic")
MAX_ANCHOR_LIMIT = 1_000_000


def _check_int(name: str, value: Any, low: int, high: int = MAX_ANCHOR_LIMIT, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= int(value) <= high:
        allowed = f"an integer in [{low}, {high}]" + (" or None" if allow_none else "")
        raise ValueError(f"ElCheStrategy: `{name}` must be {allowed}, got {value!r}")


def _check_real(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not low <= float(value) <= high:
        raise ValueError(f"ElCheStrategy: `{name}` must be a number in [{low}, {high}], got {value!r}")



def fixed_shares(policy: str, partition_ratios: Optional[Sequence[float]], max_batch_diff: Optional[int]) -> Optional[str]:
    """The setting that fixes each rank's share of a window, which dynamic dispatch has none of."""
    fixed = {
        "policy='sync'": policy == "sync",  # one step per rank per window: nothing to claim
        "`partition_ratios`": partition_ratios is not None,
        "`max_batch_diff`": max_batch_diff is not None,
    }
    return next((setting for setting, conflicts in fixed.items() if conflicts), None)


def resolve_dispatch(
    dispatch: str,
    policy: str,
    partition_ratios: Optional[Sequence[float]],
    max_batch_diff: Optional[int],
    world_size: int,
    step_milestones: bool = False,
) -> str:
    """``"auto"`` is dynamic dispatch (faster than planned in every profile ``benchmarks/dispatch.py``
    measures: steady, changing and noisy speeds) unless a setting fixes the shares, or the fit has
    ``step_milestones`` (validation or checkpoints every N steps): only planned windows land on them
    exactly, so that they fall on DDP's global steps (``limits.py``). One rank has nobody to share a
    pool with: planned, whatever was asked."""
    if world_size == 1:
        return "planned"
    if dispatch != "auto":
        return dispatch
    fixed = fixed_shares(policy, partition_ratios, max_batch_diff) is not None
    return "planned" if fixed or step_milestones else "dynamic"


@dataclass(frozen=True)
class CohortSettings:
    """The decisions' settings of :class:`~lightning_elche.ElCheStrategy` (see its docstring), checked
    and resolved: ``anchor`` and ``min_anchor`` hold their defaults, ``partition_ratios`` floats."""

    policy: str = "cadence"
    anchor: Optional[int] = None
    min_anchor: Optional[int] = None
    max_anchor: int = 1000
    overhead_target: float = 0.05
    max_batch_diff: Optional[int] = None
    partition_ratios: Optional[Sequence[float]] = None
    gamma: float = 1.0
    guard: Union[str, ConvergenceGuard] = "trend"
    divergence_threshold: Optional[float] = None
    easgd_alpha: float = 1.0
    scalar_reductions: Optional[dict[str, str]] = field(default=None)
    node_sync_every: int = 1
    ranks_per_node: Optional[int] = None
    seed: Optional[int] = None
    dispatch: str = "auto"

    def __post_init__(self) -> None:
        policy = self.policy
        if policy not in POLICIES:
            raise ValueError(f"ElCheStrategy: `policy` must be 'sync', 'cadence' or 'async', got {policy!r}")
        anchor, min_anchor = self._resolved_anchors(policy)
        _check_real("overhead_target", self.overhead_target, 0.01, 0.5)
        _check_int("max_batch_diff", self.max_batch_diff, 0, allow_none=True)
        _check_real("gamma", self.gamma, -4.0, 4.0)
        _check_real("easgd_alpha", self.easgd_alpha, 0.01, 1.0)
        reductions = dict(self.scalar_reductions or {})
        if any(not isinstance(key, str) or how not in SCALAR_REDUCTIONS for key, how in reductions.items()):
            raise ValueError(
                f"ElCheStrategy: `scalar_reductions` maps logged metric names to one of {SCALAR_REDUCTIONS}, "
                f"e.g. {{'tokens': 'sum', 'peak_mem': 'max'}}; got {self.scalar_reductions!r}"
            )
        _check_int("node_sync_every", self.node_sync_every, 1)
        _check_int("ranks_per_node", self.ranks_per_node, 1, allow_none=True)
        self._check_guard()
        if self.easgd_alpha != 1.0 and policy != "async":
            raise ValueError(
                "ElCheStrategy: `easgd_alpha` blends the average applied one window late, which only "
                f"policy='async' does; got easgd_alpha={self.easgd_alpha!r} with policy={policy!r}"
            )
        _check_int("seed", self.seed, 0, 2**63 - 1, allow_none=True)
        self._check_dispatch(policy)
        resolved = {
            "anchor": int(anchor),
            "min_anchor": int(min_anchor),
            "max_anchor": int(self.max_anchor),
            "overhead_target": float(self.overhead_target),
            "gamma": float(self.gamma),
            "easgd_alpha": float(self.easgd_alpha),
            "partition_ratios": _checked_ratios(self.partition_ratios),
            "scalar_reductions": reductions,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def _resolved_anchors(self, policy: str) -> tuple[int, int]:
        """``anchor`` and ``min_anchor`` checked, with their defaults (policy "sync": always 1)."""
        anchor, min_anchor = self.anchor, self.min_anchor
        _check_int("max_anchor", self.max_anchor, 1)
        if policy == "sync":
            if anchor not in (None, 1) or min_anchor not in (None, 1):
                raise ValueError(
                    "ElCheStrategy: policy='sync' averages after every step, so `anchor` and `min_anchor` must be "
                    f"1 or None (got anchor={anchor!r}, min_anchor={min_anchor!r}); use policy='cadence' for longer "
                    "windows"
                )
            if self.partition_ratios is not None:
                raise ValueError(
                    "ElCheStrategy: policy='sync' uses equal shares; `partition_ratios` needs policy='cadence'"
                )
            return 1, 1
        anchor = min(DEFAULT_CADENCE_ANCHOR, self.max_anchor) if anchor is None else anchor
        _check_int("anchor", anchor, 1, self.max_anchor)
        min_anchor = anchor if min_anchor is None else min_anchor
        _check_int("min_anchor", min_anchor, 1, anchor)
        return int(anchor), int(min_anchor)

    def _check_guard(self) -> None:
        if self.divergence_threshold is not None:
            _check_real("divergence_threshold", self.divergence_threshold, 0.0, 10.0)
        try:
            make_guard(self.guard, self.divergence_threshold)
        except ValueError as error:
            raise ValueError(
                f"ElCheStrategy: `guard` must be 'trend', 'msf', 'none' or a ConvergenceGuard instance, got {self.guard!r}"
            ) from error

    def _check_dispatch(self, policy: str) -> None:
        if self.dispatch not in DISPATCHES:
            raise ValueError(
                f"ElCheStrategy: `dispatch` must be 'auto', 'planned' or 'dynamic', got {self.dispatch!r}"
            )
        setting = fixed_shares(policy, self.partition_ratios, self.max_batch_diff)
        if self.dispatch == "dynamic" and setting is not None:
            raise ValueError(
                f"ElCheStrategy: `dispatch` is 'dynamic', which lets each rank claim steps while the window's pool "
                f"lasts, so there are no per-rank shares for {setting} to fix; with {setting} leave `dispatch` at "
                "'auto' (it then plans the shares) or set 'planned'"
            )

    def dispatch_mode(self, world_size: int, step_milestones: bool = False) -> str:
        """``dispatch`` resolved for ``world_size`` ranks and a fit with or without ``step_milestones``
        (:func:`resolve_dispatch`)."""
        return resolve_dispatch(
            self.dispatch, self.policy, self.partition_ratios, self.max_batch_diff, world_size, step_milestones
        )

    def controller_config(self, world_size: int) -> ControllerConfig:
        return ControllerConfig(
            world_size=world_size,
            policy=self.policy,
            anchor=int(self.anchor or DEFAULT_CADENCE_ANCHOR),
            min_anchor=self.min_anchor,
            max_anchor=self.max_anchor,
            overhead_target=self.overhead_target,
            max_batch_diff=self.max_batch_diff,
            partition_ratios=self.partition_ratios,
        )

    def make_guard(self) -> ConvergenceGuard:
        """A fresh guard for one fit (an instance given by the user is copied, so a second fit starts clean)."""
        spec = self.guard if isinstance(self.guard, str) else copy.deepcopy(self.guard)
        return make_guard(spec, self.divergence_threshold)


def _checked_ratios(partition_ratios: Any) -> Optional[list[float]]:
    if partition_ratios is None:
        return None
    ratios = list(partition_ratios) if isinstance(partition_ratios, (list, tuple)) else []
    if not ratios or any(isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r) or r <= 0 for r in ratios):
        raise ValueError(
            "ElCheStrategy: `partition_ratios` must be a list of positive numbers, one per rank, "
            f"got {partition_ratios!r}"
        )
    return [float(r) for r in ratios]
