"""ElCheStrategy's arguments, checked once, before anything is built.

The cohort's settings (policy, anchor, shares, guard, ...) are checked by
:class:`~lightning_elche.cohort.settings.CohortSettings`; the strategy's own (where the boundary
reduces, the outer optimizer, the process-group timeout, launcher details) here. Every error names
the argument, what it allows and, where there is one, the setting to use instead, so a bad YAML
value fails at parse time rather than an hour into a job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import Any, Optional, Union

from lightning_elche.cohort.settings import CohortSettings
from lightning_elche.comm.outer import OuterNesterov

DEFAULT_TIMEOUT = timedelta(minutes=5)
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("device", "cpu")


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


@dataclass(frozen=True)
class ElCheSettings:
    """Every ElCheStrategy argument, checked: the cohort's and the strategy's own."""

    cohort: CohortSettings
    backend: str
    outer_optimizer: Optional[OuterNesterov]
    timeout: timedelta
    strict_collectives: bool
    elastic: bool = False

    @classmethod
    def from_arguments(
        cls,
        *,
        backend: str,
        outer_optimizer: Optional[OuterNesterov],
        timeout: Union[timedelta, float, None],
        strict_collectives: bool,
        process_group_backend: Optional[str],
        start_method: str,
        elastic: bool = False,
        **cohort_arguments: Any,
    ) -> "ElCheSettings":
        if not isinstance(elastic, bool):
            raise ValueError(f"ElCheStrategy: `elastic` must be True or False, got {elastic!r}")
        if elastic:
            check_elastic(outer_optimizer, cohort_arguments)
            if cohort_arguments.get("dispatch", "auto") == "auto":
                cohort_arguments["dispatch"] = "planned"
        cohort = CohortSettings(**cohort_arguments)
        if backend not in BACKENDS:
            raise ValueError(f"ElCheStrategy: `backend` must be one of {BACKENDS}, got {backend!r}")
        if outer_optimizer is not None and not isinstance(outer_optimizer, OuterNesterov):
            raise ValueError(
                "ElCheStrategy: `outer_optimizer` must be None (plain averaging) or an OuterNesterov(lr=..., "
                f"momentum=...), got {outer_optimizer!r}"
            )
        if not isinstance(strict_collectives, bool):
            raise ValueError(f"ElCheStrategy: `strict_collectives` must be True or False, got {strict_collectives!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"ElCheStrategy: `start_method` must be one of {START_METHODS}, got {start_method!r}")
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise ValueError(
                f"ElCheStrategy: `process_group_backend` must be a backend name such as 'gloo' or 'nccl', "
                f"got {process_group_backend!r}"
            )
        return cls(
            cohort=cohort,
            backend=backend,
            outer_optimizer=outer_optimizer,
            timeout=to_timedelta(timeout),
            strict_collectives=strict_collectives,
            elastic=elastic,
        )


def check_elastic(outer_optimizer: Optional[OuterNesterov], cohort_arguments: dict[str, Any]) -> None:
    """What an elastic cohort does not support yet, refused before the fit starts."""
    unsupported = {
        "dispatch": (cohort_arguments.get("dispatch", "auto") == "dynamic", "dispatch='planned' (or 'auto')"),
        "policy": (cohort_arguments.get("policy", "cadence") == "async", "policy='cadence'"),
        "partition_ratios": (cohort_arguments.get("partition_ratios") is not None, "measured shares (None)"),
        "node_sync_every": ((cohort_arguments.get("node_sync_every") or 1) > 1, "node_sync_every=1"),
        "outer_optimizer": (outer_optimizer is not None, "plain averaging (None)"),
    }
    for name, (refused, instead) in unsupported.items():
        if refused:
            raise ValueError(
                f"ElCheStrategy(elastic=True) does not support `{name}`={cohort_arguments.get(name, outer_optimizer)!r} "
                f"yet: a cohort that changes size re-plans from the survivors' state, which this setting does not "
                f"carry over. Use {instead}, or elastic=False."
            )
