"""ElCheStrategy's settings, by concern, each checked once before anything is built.

Six groups, each a frozen dataclass a user (or a LightningCLI config, which jsonargparse reads as
nested dataclasses) can build on its own: :class:`Window` (how long windows are, and the guard that
shortens them), :class:`Averaging` (what a boundary does with the replicas), :class:`Data` (how the
epoch's samples reach the ranks), :class:`Faults` (what a lost rank does to the fit), :class:`Links`
(slow links: compression, streaming, the link's speed) and :class:`Reporting`. :class:`ElCheSettings`
holds them checked and resolved, with the core's view of them (``cohort/settings.py``). Every error
names the setting, what it allows and, where there is one, the setting to use instead, so a bad
YAML value fails when the strategy is constructed rather than an hour into a job.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import timedelta
from numbers import Integral, Real
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence, Union

from lightning_elche.cohort.guards import ConvergenceGuard
from lightning_elche.cohort.settings import CohortSettings
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.comm.quantize import COMPRESSIONS

DEFAULT_TIMEOUT_S = 300.0
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
REDUCE_ON = ("device", "cpu")
MicroBatchSizes = Union[Sequence[int], Mapping[int, int]]


class SimulatedLink(Protocol):
    """A slower link between the ranks, simulated (:class:`lightning_elche.SlowLink` is one)."""

    mbit_s: float
    latency_ms: float

    def seconds(self, sent_bytes: int) -> float: ...


@dataclass(frozen=True)
class Window:
    """How long windows are: the slowest rank's steps per window (``anchor``), tuned so that a boundary
    costs ``overhead_target`` of a window, within ``[min_anchor, max_anchor]``; ``max_batch_diff`` bounds
    how many more steps a faster rank may run; the convergence ``guard`` ("trend", "msf", "none" or a
    ConvergenceGuard) holds the anchor's growth or shrinks it when replicas drift apart, never below
    ``divergence_threshold``. ``anchor`` defaults to 10 (1 under policy "sync"), ``min_anchor`` to it."""

    anchor: Optional[int] = None
    min_anchor: Optional[int] = None
    max_anchor: int = 1000
    overhead_target: float = 0.05
    max_batch_diff: Optional[int] = None
    guard: Union[str, ConvergenceGuard] = "trend"
    divergence_threshold: Optional[float] = None


@dataclass(frozen=True)
class Averaging:
    """What a boundary does: ``policy`` "cadence" (faster ranks run more steps and get more data, the
    window tuned to the overhead target), "sync" (a boundary after every step, equal shares: DDP with
    plain SGD) or "async" (the parameter reduce runs while the next window trains, applied one window
    late, blended by ``easgd_alpha``); weights ``steps ** gamma``; DiLoCo's ``outer_optimizer``;
    hierarchical averaging (ranks of a node every window, all ranks every ``node_sync_every``, a node
    ``ranks_per_node`` consecutive ranks, by default Lightning's devices per node); ``reduce_on``
    "device" (NCCL on GPUs) or "cpu" (staged through host memory over gloo)."""

    policy: Literal["sync", "cadence", "async"] = "cadence"
    gamma: float = 1.0
    outer_optimizer: Union[OuterNesterov, Literal["auto", "none"], None] = "auto"
    easgd_alpha: float = 1.0
    node_sync_every: int = 1
    ranks_per_node: Optional[int] = None
    reduce_on: Literal["device", "cpu"] = "device"


@dataclass(frozen=True)
class Data:
    """How the epoch's samples reach the ranks: ``dispatch`` "dynamic" (each rank claims its next step
    from the window's pool), "planned" (shares decided a window ahead from measured speeds) or "auto"
    (dynamic unless the shares are fixed); fixed ``partition_ratios``; the permutation's ``seed`` (default:
    the DistributedSampler's); ``micro_batch_sizes``, each rank's own DataLoader batch (a list in rank
    order or a mapping {rank: size}, each dividing the loader's batch_size)."""

    dispatch: Literal["auto", "planned", "dynamic"] = "auto"
    partition_ratios: Optional[Sequence[float]] = None
    seed: Optional[int] = None
    micro_batch_sizes: Optional[MicroBatchSizes] = None


@dataclass(frozen=True)
class Faults:
    """What a lost rank does: with ``elastic`` the others go on without it from the next boundary (launch
    with ``python -m lightning_elche.launch``), otherwise every rank stops with an error naming it after
    ``timeout`` (a timedelta or seconds); ``strict_collectives`` refuses a collective issued inside a
    training batch, where it would deadlock."""

    elastic: bool = False
    timeout: Union[timedelta, float] = DEFAULT_TIMEOUT_S
    strict_collectives: bool = True


@dataclass(frozen=True)
class Links:
    """Slow links: send each rank's change since the last consensus ``compression``-ed ("bf16", "int8",
    "fp8", with error feedback), average the parameters in ``fragments`` turns, size the anchor for a
    known ``link_mbit_s`` from the first window; ``simulated_link`` slows every boundary to a simulated
    link (benchmarks, tests: :class:`lightning_elche.SlowLink`)."""

    compression: Optional[Literal["bf16", "int8", "fp8"]] = None
    fragments: int = 1
    link_mbit_s: Optional[float] = None
    simulated_link: Optional[SimulatedLink] = None
    link_latency_ms: float = field(init=False, default=0.0)  # the simulated link's, where the controller is told it


@dataclass(frozen=True)
class Reporting:
    """``scalar_reductions``: metrics ``training_step`` logs per rank, rolled up across ranks at every
    boundary ("sum", "mean", "max", "min") and logged as ``elche/user/<name>``."""

    scalar_reductions: Optional[dict[str, str]] = None

    @property
    def reductions(self) -> dict[str, str]:
        return dict(self.scalar_reductions or {})


GROUPS: dict[str, type] = {
    "window": Window, "averaging": Averaging, "data": Data, "faults": Faults, "links": Links, "reporting": Reporting,
}  # fmt: skip
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}  # setting -> its group


@dataclass(frozen=True)
class ElCheSettings:
    """Every setting of ElCheStrategy, checked and resolved, by group; ``cohort`` is the core's view of
    the window, averaging and data groups (resolved defaults, the dispatch rule)."""

    window: Window = field(default_factory=Window)
    averaging: Averaging = field(default_factory=Averaging)
    data: Data = field(default_factory=Data)
    faults: Faults = field(default_factory=Faults)
    links: Links = field(default_factory=Links)
    reporting: Reporting = field(default_factory=Reporting)
    cohort: CohortSettings = field(init=False)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"ElCheStrategy: `{name}` must be a lightning_elche.{cls.__name__}(...), got {getattr(self, name)!r}"
                )
        window, averaging, data = self.window, self.averaging, self.data
        cohort = CohortSettings(
            policy=averaging.policy, anchor=window.anchor, min_anchor=window.min_anchor, max_anchor=window.max_anchor,
            overhead_target=window.overhead_target, max_batch_diff=window.max_batch_diff,
            partition_ratios=data.partition_ratios, gamma=averaging.gamma, guard=window.guard,
            divergence_threshold=window.divergence_threshold, easgd_alpha=averaging.easgd_alpha,
            scalar_reductions=self.reporting.scalar_reductions, node_sync_every=averaging.node_sync_every,
            ranks_per_node=averaging.ranks_per_node, seed=data.seed, dispatch=data.dispatch,
        )  # fmt: skip
        object.__setattr__(self, "cohort", cohort)
        resolved = {  # the groups as the core resolved them: defaults filled in, numbers as floats
            "window": dataclasses.replace(
                window, anchor=cohort.anchor, min_anchor=cohort.min_anchor, max_anchor=cohort.max_anchor,
                overhead_target=cohort.overhead_target,
            ),
            "averaging": dataclasses.replace(
                averaging, gamma=cohort.gamma, easgd_alpha=cohort.easgd_alpha, outer_optimizer=_resolved_outer(averaging)
            ),
            "data": dataclasses.replace(data, partition_ratios=cohort.partition_ratios),
            "reporting": Reporting(cohort.scalar_reductions),
        }  # fmt: skip
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        _check_averaging(averaging)
        check_micro_batch_sizes(data.micro_batch_sizes)
        object.__setattr__(self, "faults", _checked_faults(self.faults))
        object.__setattr__(self, "links", _checked_links(self.links))
        _check_combinations(self)

    @classmethod
    def from_arguments(cls, groups: Mapping[str, Any], flat: Mapping[str, Any]) -> "ElCheSettings":
        """The settings from ElCheStrategy's groups and its flat arguments: each flat one is a field of one
        group (:data:`GROUP_OF`), set there; a flat one that contradicts the group given is refused."""
        merged = {name: group for name, group in groups.items() if group is not None}
        for name, value in flat.items():
            if name not in GROUP_OF:
                known = ", ".join(sorted(GROUP_OF))
                raise TypeError(f"ElCheStrategy got an unknown setting `{name}`; the settings are: {known}")
            group_name = GROUP_OF[name]
            group = merged.get(group_name) or GROUPS[group_name]()
            given = getattr(group, name)
            default = next(f.default for f in dataclasses.fields(GROUPS[group_name]) if f.name == name)
            if group_name in groups and groups[group_name] is not None and given != default and given != value:
                raise ValueError(
                    f"ElCheStrategy: `{name}`={value!r} contradicts `{group_name}`'s {name}={given!r}; give it once"
                )
            merged[group_name] = dataclasses.replace(group, **{name: value})
        return cls(**merged)

    @property
    def outer_optimizer(self) -> Optional[OuterNesterov]:
        """The outer optimizer the boundaries step (None: plain averaging), ``"auto"`` resolved."""
        outer = self.averaging.outer_optimizer
        assert outer is None or isinstance(outer, OuterNesterov)  # __post_init__ resolved it
        return outer

    @property
    def timeout(self) -> timedelta:
        """The process-group timeout, checked (``faults.timeout`` as a timedelta)."""
        assert isinstance(self.faults.timeout, timedelta)  # _checked_faults made it one
        return self.faults.timeout


def _check_averaging(averaging: Averaging) -> None:
    if averaging.reduce_on not in REDUCE_ON:
        raise ValueError(f"ElCheStrategy: `reduce_on` must be one of {REDUCE_ON}, got {averaging.reduce_on!r}")


def _resolved_outer(averaging: Averaging) -> Optional[OuterNesterov]:
    """``"auto"``: DiLoCo's outer step where the members' speeds differ (``OuterNesterov.following_speed``);
    ``"none"`` or None: plain averaging; an OuterNesterov as given."""
    outer = averaging.outer_optimizer
    if outer == "auto":
        return OuterNesterov.following_speed()
    if outer is None or outer == "none":
        return None
    if not isinstance(outer, OuterNesterov):
        raise ValueError(
            f"ElCheStrategy: `outer_optimizer` must be \"auto\" (the default: an outer step where speeds differ), "
            f"\"none\" (plain averaging) or an OuterNesterov(lr=..., momentum=...), got {outer!r}"
        )
    return outer


def _check_combinations(settings: ElCheSettings) -> None:
    """The one pair of groups that cannot be set together (docs/compatibility.md says why): fixed shares
    per rank for a cohort whose ranks change."""
    ratios = settings.data.partition_ratios
    if settings.faults.elastic and ratios is not None:
        raise ValueError(
            f"ElCheStrategy(elastic=True) cannot take `partition_ratios`={list(ratios)!r}: they fix one share per "
            "rank, and an elastic cohort's ranks come and go (a rank's ratio would fall to whichever member takes "
            "its rank). Leave the shares to the measured speeds (partition_ratios=None), or use elastic=False."
        )


def to_timedelta(value: Union[timedelta, float, int, None]) -> timedelta:
    if value is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
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


def _checked_faults(faults: Faults) -> Faults:
    for name in ("elastic", "strict_collectives"):
        if not isinstance(getattr(faults, name), bool):
            raise ValueError(f"ElCheStrategy: `{name}` must be True or False, got {getattr(faults, name)!r}")
    return dataclasses.replace(faults, timeout=to_timedelta(faults.timeout))


def _checked_links(links: Links) -> Links:
    compression, fragments, link_mbit_s = links.compression, links.fragments, links.link_mbit_s
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(
            f"ElCheStrategy: `compression` must be None (full precision, the default) or one of {COMPRESSIONS}, "
            f"got {compression!r}"
        )
    if isinstance(fragments, bool) or not isinstance(fragments, Integral) or int(fragments) < 1:
        raise ValueError(f"ElCheStrategy: `fragments` must be an integer >= 1 (1: no streaming), got {fragments!r}")
    if link_mbit_s is not None and (
        isinstance(link_mbit_s, bool) or not isinstance(link_mbit_s, Real)
        or not (math.isfinite(link_mbit_s) and float(link_mbit_s) > 0)
    ):  # fmt: skip
        raise ValueError(
            f"ElCheStrategy: `link_mbit_s` must be None (measure it) or the slowest link's bandwidth in megabits "
            f"per second, a positive number, got {link_mbit_s!r}"
        )
    simulated = links.simulated_link
    if simulated is not None and not all(hasattr(simulated, name) for name in ("mbit_s", "latency_ms", "seconds")):
        raise ValueError(f"ElCheStrategy: `simulated_link` must be None or a SlowLink(mbit_s=...), got {simulated!r}")
    told = float(link_mbit_s) if link_mbit_s is not None else None if simulated is None else simulated.mbit_s
    checked = dataclasses.replace(links, fragments=int(fragments), link_mbit_s=told)
    if link_mbit_s is None and simulated is not None:
        object.__setattr__(checked, "link_latency_ms", float(simulated.latency_ms))
    return checked


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
