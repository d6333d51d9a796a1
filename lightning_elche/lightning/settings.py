"""ElCheStrategy's constructor arguments, checked before anything is built.

Every error names the argument, what it allows and, where there is one, the setting to use
instead, so a bad YAML value fails at parse time rather than an hour into a job.
"""

from __future__ import annotations

import math
from datetime import timedelta
from numbers import Integral, Real
from typing import Any, NamedTuple, Optional, Sequence, Union

from lightning_elche.cohort.guards import ConvergenceGuard, make_guard
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.lightning.telemetry import SCALAR_REDUCTIONS

DEFAULT_TIMEOUT = timedelta(minutes=5)
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_CADENCE_ANCHOR = 10
MAX_ANCHOR_LIMIT = 1_000_000
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("device", "cpu")


def _check_int(name: str, value: Any, low: int, high: int = MAX_ANCHOR_LIMIT, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value <= high:
        allowed = f"an integer in [{low}, {high}]" + (" or None" if allow_none else "")
        raise ValueError(f"ElCheStrategy: `{name}` must be {allowed}, got {value!r}")


def _check_real(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"ElCheStrategy: `{name}` must be a number in [{low}, {high}], got {value!r}")


def to_timedelta(value: Union[timedelta, float, int, None]) -> timedelta:
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"ElCheStrategy: `timeout` must be a timedelta or seconds > 0, got {value!r}")
    if not math.isfinite(seconds) or not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise ValueError(
            f"ElCheStrategy: `timeout` must be between {MIN_TIMEOUT_S:g} s and {MAX_TIMEOUT_S:g} s (7 days), got {value!r}"
        )
    return timedelta(seconds=seconds)


class CheckedArguments(NamedTuple):
    """The arguments whose stored value differs from the given one (defaults resolved, types fixed)."""

    anchor: int
    min_anchor: int
    partition_ratios: Optional[list[float]]
    scalar_reductions: dict[str, str]
    timeout: timedelta


def check_arguments(
    *,
    policy: str,
    backend: str,
    anchor: Optional[int],
    min_anchor: Optional[int],
    max_anchor: int,
    overhead_target: float,
    max_batch_diff: Optional[int],
    partition_ratios: Optional[Sequence[float]],
    gamma: float,
    guard: Union[str, ConvergenceGuard],
    divergence_threshold: Optional[float],
    outer_optimizer: Optional[OuterNesterov],
    easgd_alpha: float,
    scalar_reductions: Optional[dict[str, str]],
    node_sync_every: int,
    ranks_per_node: Optional[int],
    seed: Optional[int],
    timeout: Union[timedelta, float, None],
    strict_collectives: bool,
    process_group_backend: Optional[str],
    start_method: str,
) -> CheckedArguments:
    if policy not in ("sync", "cadence", "async"):
        raise ValueError(f"ElCheStrategy: `policy` must be 'sync', 'cadence' or 'async', got {policy!r}")
    if backend not in BACKENDS:
        raise ValueError(f"ElCheStrategy: `backend` must be one of {BACKENDS}, got {backend!r}")
    _check_int("max_anchor", max_anchor, 1)
    if policy == "sync":
        if anchor not in (None, 1) or min_anchor not in (None, 1):
            raise ValueError(
                "ElCheStrategy: policy='sync' averages after every step, so `anchor` and `min_anchor` must be "
                f"1 or None (got anchor={anchor!r}, min_anchor={min_anchor!r}); use policy='cadence' for longer windows"
            )
        if partition_ratios is not None:
            raise ValueError(
                "ElCheStrategy: policy='sync' uses equal shares; `partition_ratios` needs policy='cadence'"
            )
        anchor = min_anchor = 1
    anchor = min(DEFAULT_CADENCE_ANCHOR, max_anchor) if anchor is None else anchor
    _check_int("anchor", anchor, 1, max_anchor)
    min_anchor = anchor if min_anchor is None else min_anchor
    _check_int("min_anchor", min_anchor, 1, anchor)
    _check_real("overhead_target", overhead_target, 0.01, 0.5)
    _check_int("max_batch_diff", max_batch_diff, 0, allow_none=True)
    if partition_ratios is not None:
        ratios = list(partition_ratios) if isinstance(partition_ratios, (list, tuple)) else []
        if not ratios or any(
            isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r) or r <= 0 for r in ratios
        ):
            raise ValueError(
                "ElCheStrategy: `partition_ratios` must be a list of positive numbers, one per rank, "
                f"got {partition_ratios!r}"
            )
        partition_ratios = [float(r) for r in ratios]
    _check_real("gamma", gamma, -4.0, 4.0)
    _check_real("easgd_alpha", easgd_alpha, 0.01, 1.0)
    scalar_reductions = dict(scalar_reductions or {})
    if any(not isinstance(key, str) or how not in SCALAR_REDUCTIONS for key, how in scalar_reductions.items()):
        raise ValueError(
            f"ElCheStrategy: `scalar_reductions` maps logged metric names to one of {SCALAR_REDUCTIONS}, "
            f"e.g. {{'tokens': 'sum', 'peak_mem': 'max'}}; got {scalar_reductions!r}"
        )
    _check_int("node_sync_every", node_sync_every, 1)
    _check_int("ranks_per_node", ranks_per_node, 1, allow_none=True)
    if node_sync_every > 1 and policy == "async":
        raise ValueError(
            "ElCheStrategy: `node_sync_every` > 1 (hierarchical averaging) cannot be combined with "
            "policy='async'; use policy='cadence'"
        )
    if divergence_threshold is not None:
        _check_real("divergence_threshold", divergence_threshold, 0.0, 10.0)
    try:
        make_guard(guard, divergence_threshold)
    except ValueError as error:
        raise ValueError(
            f"ElCheStrategy: `guard` must be 'trend', 'msf', 'none' or a ConvergenceGuard instance, got {guard!r}"
        ) from error
    if easgd_alpha != 1.0 and policy != "async":
        raise ValueError(
            "ElCheStrategy: `easgd_alpha` blends the average applied one window late, which only "
            f"policy='async' does; got easgd_alpha={easgd_alpha!r} with policy={policy!r}"
        )
    if outer_optimizer is not None and not isinstance(outer_optimizer, OuterNesterov):
        raise ValueError(
            "ElCheStrategy: `outer_optimizer` must be None (plain averaging) or an OuterNesterov(lr=..., "
            f"momentum=...), got {outer_optimizer!r}"
        )
    _check_int("seed", seed, 0, 2**63 - 1, allow_none=True)
    if not isinstance(strict_collectives, bool):
        raise ValueError(f"ElCheStrategy: `strict_collectives` must be True or False, got {strict_collectives!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"ElCheStrategy: `start_method` must be one of {START_METHODS}, got {start_method!r}")
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise ValueError(
            f"ElCheStrategy: `process_group_backend` must be a backend name such as 'gloo' or 'nccl', "
            f"got {process_group_backend!r}"
        )
    return CheckedArguments(
        anchor=int(anchor),
        min_anchor=int(min_anchor),
        partition_ratios=partition_ratios,
        scalar_reductions=scalar_reductions,
        timeout=to_timedelta(timeout),
    )
