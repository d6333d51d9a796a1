"""ElCheStrategy's arguments, checked once, before anything is built.

The cohort's settings (policy, anchor, shares, guard, ...) are checked by
:class:`~lightning_elche.cohort.settings.CohortSettings`; the strategy's own (where the boundary
reduces, the outer optimizer, the process-group timeout, per-rank micro-batches, launcher details)
here. Every error names the argument, what it allows and, where there is one, the setting to use
instead, so a bad YAML value fails at parse time rather than an hour into a job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from numbers import Integral, Real
from typing import Any, Mapping, Optional, Sequence, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lightning_elche.cohort.settings import CohortSettings
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.comm.quantize import COMPRESSIONS
from lightning_elche.sim.slowdown import SlowLink

DEFAULT_TIMEOUT = timedelta(minutes=5)
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
START_METHODS = ("popen", "spawn", "fork", "forkserver")
REDUCE_ON = ("device", "cpu")
MicroBatchSizes = Union[Sequence[int], Mapping[int, int]]


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
    reduce_on: str
    outer_optimizer: Optional[OuterNesterov]
    timeout: timedelta
    strict_collectives: bool
    elastic: bool = False
    compression: Optional[str] = None
    fragments: int = 1
    link_mbit_s: Optional[float] = None  # what the controller is told: the user's hint or the simulated link's
    link_latency_ms: float = 0.0
    simulated_link: Optional[SlowLink] = None
    micro_batch_sizes: Optional[MicroBatchSizes] = None  # checked against the world size when the fit starts

    @classmethod
    def from_arguments(
        cls,
        *,
        reduce_on: str,
        backend: Optional[str],
        outer_optimizer: Optional[OuterNesterov],
        timeout: Union[timedelta, float, None],
        strict_collectives: bool,
        process_group_backend: Optional[str],
        start_method: str,
        elastic: bool = False,
        compression: Optional[str] = None,
        fragments: int = 1,
        link_mbit_s: Optional[float] = None,
        simulated_link: Optional[SlowLink] = None,
        micro_batch_sizes: Optional[MicroBatchSizes] = None,
        **cohort_arguments: Any,
    ) -> "ElCheSettings":
        if not isinstance(elastic, bool):
            raise ValueError(f"ElCheStrategy: `elastic` must be True or False, got {elastic!r}")
        if elastic:
            check_elastic(outer_optimizer, {
                **cohort_arguments, "compression": compression, "fragments": fragments, "micro_batch_sizes": micro_batch_sizes,
            })  # fmt: skip
            if cohort_arguments.get("dispatch", "auto") == "auto":
                cohort_arguments["dispatch"] = "planned"
        cohort = CohortSettings(**cohort_arguments)
        reduce_on = _reduce_on(reduce_on, backend)
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
        check_link(cohort, compression, fragments, link_mbit_s, simulated_link)
        check_micro_batch_sizes(micro_batch_sizes)
        link = simulated_link if link_mbit_s is None else None
        return cls(
            cohort=cohort,
            reduce_on=reduce_on,
            outer_optimizer=outer_optimizer,
            timeout=to_timedelta(timeout),
            strict_collectives=strict_collectives,
            elastic=elastic,
            compression=compression,
            fragments=int(fragments),
            link_mbit_s=link.mbit_s if link is not None else None if link_mbit_s is None else float(link_mbit_s),
            link_latency_ms=link.latency_ms if link is not None else 0.0,
            simulated_link=simulated_link,
            micro_batch_sizes=micro_batch_sizes,
        )


def _reduce_on(reduce_on: Any, backend: Any) -> str:
    """``reduce_on``, or the deprecated ``backend`` it was called before (easily taken for DDP's
    ``process_group_backend``, so a process-group backend name there is refused pointing to it)."""
    if reduce_on not in REDUCE_ON:
        raise ValueError(f"ElCheStrategy: `reduce_on` must be one of {REDUCE_ON}, got {reduce_on!r}")
    if backend is None:
        return reduce_on
    if backend not in REDUCE_ON:
        raise ValueError(
            f"ElCheStrategy: `backend`={backend!r} is not a process-group backend: it was where the boundary "
            f"reduces, now `reduce_on` ('device' or 'cpu'). For the process group's backend (gloo, nccl) "
            f"use `process_group_backend`={backend!r}"
        )
    if reduce_on != "device":
        raise ValueError("ElCheStrategy: give `reduce_on` only; `backend` is its deprecated name")
    rank_zero_deprecation(
        f"ElCheStrategy(backend={backend!r}) is deprecated and will be removed in 0.3: use reduce_on={backend!r}"
    )
    return backend


def check_micro_batch_sizes(sizes: Any) -> None:
    """One positive integer per rank, as a list in rank order or a mapping {global rank: size}; whether
    there is one per rank and each divides the DataLoader's batch size is checked when the fit starts."""
    if sizes is None:
        return
    if isinstance(sizes, Mapping):
        pairs = list(sizes.items())
    elif isinstance(sizes, Sequence) and not isinstance(sizes, (str, bytes)) and len(sizes) > 0:
        pairs = list(enumerate(sizes))
    else:
        pairs = []

    def integer(x: Any, least: int) -> bool:
        return isinstance(x, Integral) and not isinstance(x, bool) and int(x) >= least

    if not pairs or not all(integer(rank, 0) and integer(size, 1) for rank, size in pairs):
        raise ValueError(
            "ElCheStrategy: `micro_batch_sizes` must be None (every rank uses the DataLoader's batch_size) or one "
            "positive integer per rank, as a list in rank order ([64, 32]) or a mapping {global rank: size} "
            f"({{1: 32}}), got {sizes!r}"
        )


def check_link(
    cohort: CohortSettings, compression: Any, fragments: Any, link_mbit_s: Any, simulated_link: Any
) -> None:
    """The slow-link settings: known values, and no policy whose boundary they do not implement."""
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(
            f"ElCheStrategy: `compression` must be None (full precision, the default) or one of {COMPRESSIONS}, "
            f"got {compression!r}"
        )
    if isinstance(fragments, bool) or not isinstance(fragments, Integral) or int(fragments) < 1:
        raise ValueError(f"ElCheStrategy: `fragments` must be an integer >= 1 (1: no streaming), got {fragments!r}")
    if link_mbit_s is not None and (
        isinstance(link_mbit_s, bool) or not isinstance(link_mbit_s, Real) or not (math.isfinite(link_mbit_s) and float(link_mbit_s) > 0)
    ):
        raise ValueError(
            f"ElCheStrategy: `link_mbit_s` must be None (measure it) or the slowest link's bandwidth in megabits "
            f"per second, a positive number, got {link_mbit_s!r}"
        )
    if simulated_link is not None and not isinstance(simulated_link, SlowLink):
        raise ValueError(f"ElCheStrategy: `simulated_link` must be None or a SlowLink(mbit_s=...), got {simulated_link!r}")
    if compression is None and fragments == 1:
        return
    asked = f"compression={compression!r}" if compression is not None else f"fragments={fragments}"
    if cohort.policy == "async":
        raise ValueError(
            f"ElCheStrategy: {asked} is not implemented for policy='async' (its background reduce sends full "
            "parameters); use policy='cadence', whose boundaries it then makes cheap"
        )
    if cohort.node_sync_every > 1:
        raise ValueError(
            f"ElCheStrategy: {asked} cannot be combined with hierarchical averaging (`node_sync_every` > 1) yet; "
            "use one of the two"
        )


def check_elastic(outer_optimizer: Optional[OuterNesterov], cohort_arguments: dict[str, Any]) -> None:
    """What an elastic cohort does not support yet, refused before the fit starts."""
    unsupported = {
        "dispatch": (cohort_arguments.get("dispatch", "auto") == "dynamic", "dispatch='planned' (or 'auto')"),
        "policy": (cohort_arguments.get("policy", "cadence") == "async", "policy='cadence'"),
        "partition_ratios": (cohort_arguments.get("partition_ratios") is not None, "measured shares (None)"),
        "node_sync_every": ((cohort_arguments.get("node_sync_every") or 1) > 1, "node_sync_every=1"),
        "outer_optimizer": (outer_optimizer is not None, "plain averaging (None)"),
        "compression": (cohort_arguments.get("compression") is not None, "compression=None"),
        "fragments": (cohort_arguments.get("fragments", 1) != 1, "fragments=1"),
        "micro_batch_sizes": (cohort_arguments.get("micro_batch_sizes") is not None, "one batch size for every rank"),
    }
    for name, (refused, instead) in unsupported.items():
        if refused:
            raise ValueError(
                f"ElCheStrategy(elastic=True) does not support `{name}`={cohort_arguments.get(name, outer_optimizer)!r} "
                f"yet: a cohort that changes size re-plans from the survivors' state, which this setting does not "
                f"carry over. Use {instead}, or elastic=False."
            )
