"""One epoch's dispatch, as the cohort core and the sampler use it, whatever the dispatch mode.

Two kinds answer it: :class:`~lightning_elche.cohort.plan.EpochPlan` (planned dispatch: each rank's
piece of every window decided a little ahead from measured speeds) and
:class:`~lightning_elche.cohort.pool.PoolEpoch` (dynamic dispatch: the window's samples are a pool of
one-step tickets the ranks claim as they go). ``TrainData.plan`` chooses the kind once per epoch;
after that nothing asks which kind it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from lightning_elche.cohort.claims import Claiming, Claims
    from lightning_elche.cohort.coverage import Spans


WindowCap = Callable[[int], Optional[int]]
"""Steps of all ranks the next window may take, given the steps of the windows already decided and not
closed yet ahead of it (None: no limit): what lands the cohort on ``max_steps`` and on each milestone."""


class Epoch(Protocol):
    """An epoch's windows and this rank's part in them."""

    epoch: int
    complete: bool  # the final window is decided
    window_claim_ms: float  # time this rank spent claiming in the current window (0 when nothing is claimed)
    finished: bool  # this rank trained its last batch of the epoch and has no step left in any window

    @property
    def window_count(self) -> int: ...

    @property
    def total_steps(self) -> Optional[int]: ...  # optimizer steps of all ranks in the epoch (None: endless)

    @property
    def usable(self) -> int: ...  # samples of the epoch that are trained (``drop_last`` drops a short tail)

    def is_final(self, window: int) -> bool: ...

    def data_left_after(self, window: int) -> bool: ...

    def limit(self, steps_left: Optional[int]) -> None:
        """Train at most ``steps_left`` steps of all ranks this epoch (``max_steps``; None: no limit)."""

    def open_windows(
        self, next_window: int, plan_steps: Callable[[], Sequence[int]], rank: int, lookahead_batches: int,
        window_cap: WindowCap,
    ) -> None:
        """Decide the windows the DataLoader may reach before the boundary that closes ``next_window - 1``
        (``window_cap``: how long each may be; a pool's windows carry tickets over, so it lands only on
        ``max_steps``, through :meth:`limit`)."""

    def serve(self, rank: int, claiming: Claiming) -> Iterator[int]:
        """The sample indices ``rank`` trains this epoch, in training order (the sampler's iterator)."""

    def batch_trained(
        self, window: int, rank: int, batches: int, last_batch: bool, peek: Optional[Callable[[int], int]] = None
    ) -> bool:
        """A batch ended; whether it closes this rank's window."""

    def boundary_due(self, next_window: int) -> bool: ...

    def trained_samples(self, window: int, rank: int) -> int: ...

    def window_closed(self) -> None: ...

    def progress(self, window: int, rank: int, batches: int, units: int, share: float = 0.0) -> int: ...

    def logged_units(self, window: int, automatic_optimization: bool) -> int: ...

    def covered_at(self, closed_windows: int, all_claims: Callable[[Claims], list[Claims]]) -> Spans:
        """The positions of the epoch's order trained at a boundary (``all_claims``: a gather of every
        rank's claims, called only where the kind needs it, on every rank alike)."""

    def claims(self) -> Optional[Claims]:
        """This rank's claims now (None where nothing is claimed: every rank knows every rank's pieces)."""

    def trained_in_window(self) -> list[int]:
        """The tickets this rank trained since the last boundary (empty where nothing is claimed)."""

    def covered_after_loss(
        self, closed_windows: int, survivors: Sequence[int], at_boundary: Sequence[Claims], trained_since: Sequence[int]
    ) -> Spans:
        """The positions trained once the ``survivors`` (ranks) of a lost rank average the window after
        ``closed_windows``, given every rank's claims at the last boundary (``at_boundary``; empty where
        nothing is claimed) and the tickets the survivors trained since (``trained_since``)."""

    def fingerprints(self) -> dict[str, float]: ...
