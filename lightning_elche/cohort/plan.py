"""Training-data partition: one seeded permutation per epoch, handed out window by window.

Every rank holds an identical :class:`EpochPlan`. Window w gives each rank a contiguous piece of
the epoch's order, sized by the controller's step counts, so a faster rank gets a larger share
and the shares can change at every boundary, inside an epoch. Pieces are disjoint by
construction, so each sample of the epoch is trained exactly once across ranks.

The DataLoader pulls indices ahead of training (Lightning's one-batch prefetch, plus
``prefetch_factor * num_workers`` with worker processes), so a window's pieces are fixed
("frozen") far enough ahead that the sampler never asks for a window nobody has decided yet.

The sampler has no ``__len__`` on purpose: Lightning then ends the epoch at exhaustion and caches
no per-rank lengths (Lightning 2.6's fit loop; docs/how-it-works.md, the sampler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from lightning_elche.cohort.claims import Claiming, Claims
from lightning_elche.cohort.controller import split_by_weights
from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.epoch import Epoch, WindowCap
from lightning_elche.cohort.fingerprint import data_fields, digest, to_field
from lightning_elche.cohort.order import EpochOrder
from lightning_elche.cohort.pool import usable_samples


class EpochPlan:
    """The epoch's order and the per-rank pieces of every frozen window.

    ``samples_per_step`` is batch size x gradient-accumulation batches, so that a window of n
    steps is exactly n optimizer steps. The last window takes whatever remains, split in
    proportion to the requested steps with at least one batch per rank, so every rank sees the
    same number of windows and ends its epoch on a boundary. Without an ``order`` the epoch never
    ends (the simulator's runs without epochs): windows are only counted, never handed out.
    """

    def __init__(
        self,
        epoch: int,
        order: Optional[Union[EpochOrder, torch.Tensor]],
        world_size: int,
        batch_size: int,
        samples_per_step: int,
        drop_last: bool = False,
        num_samples: Optional[int] = None,
        seed: Optional[int] = None,
        shuffle: Optional[bool] = None,
        rank_batch_sizes: Optional[Sequence[int]] = None,
    ) -> None:
        self.epoch = epoch
        self.order = EpochOrder(order) if isinstance(order, torch.Tensor) else order
        self.num_samples = (0 if order is None else len(order)) if num_samples is None else num_samples
        self.world_size = world_size
        self.batch_size = batch_size
        self.rank_batch_sizes = tuple(rank_batch_sizes or (batch_size,) * world_size)
        self.samples_per_step = samples_per_step
        self.drop_last = drop_last
        self.cursor = 0
        self.starts: list[list[int]] = []  # per window, per rank: offset into ``order``
        self.sizes: list[list[int]] = []  # per window, per rank: number of samples
        self.complete = False  # the final window is frozen
        self._data_fields = data_fields(
            seed=seed, num_samples=self.num_samples, shuffle=shuffle, batch_size=batch_size,
            samples_per_step=samples_per_step, drop_last=drop_last,
            order=None if self.order is None else self.order.digest(),
        )
        self._windows_digest = digest(epoch)  # extended by every frozen window (fingerprint())
        if self.order is not None:
            self._check_size(len(self.order), len(self.order) < len(self.order.base))

    def _check_size(self, samples: int, resumed: bool) -> None:
        minimum = self.world_size * (self.batch_size if self.drop_last else 1)
        if resumed and (samples == 0 or (self.drop_last and samples < minimum)):
            self.complete = True  # a resumed epoch with nothing left (or only what drop_last drops)
        elif samples < minimum:
            left = " left to train after the resume" if resumed else ""
            raise ValueError(
                f"the training set of epoch {self.epoch} has {samples} samples{left}, too few to give each of "
                f"{self.world_size} ranks a batch; use a larger dataset or fewer devices"
            )

    @property
    def remaining(self) -> float:
        return math.inf if self.order is None else len(self.order) - self.cursor

    @property
    def usable(self) -> int:
        """Samples of the epoch that are trained (``drop_last`` drops a tail short of a batch)."""
        return usable_samples(0 if self.order is None else len(self.order), self.batch_size, self.drop_last)

    @property
    def total_steps(self) -> Optional[int]:
        """Optimizer steps of all ranks in the whole epoch (None for an endless one)."""
        return None if self.order is None else len(self.order) // self.samples_per_step

    @property
    def window_count(self) -> int:
        return len(self.sizes)

    def is_final(self, window: int) -> bool:
        return self.complete and window == len(self.sizes) - 1

    def data_left_after(self, window: int) -> bool:
        """Whether the epoch has samples beyond ``window`` (``max_steps`` may end the fit before them)."""
        return not self.is_final(window)

    def batch_trained(
        self, window: int, rank: int, batches: int, last_batch: bool, peek: Optional[Callable[[int], int]] = None
    ) -> bool:
        """This rank's ``batches``-th batch of ``window`` ended; True when it closes the window (the
        pieces are fixed: nothing to ``peek`` at)."""
        if window >= len(self.sizes):
            raise RuntimeError(
                f"rank {rank} trained more batches than ElChe planned for epoch {self.epoch}; the train "
                "DataLoader must yield one batch per `batch_size` indices of its sampler"
            )
        if batches >= self.batches(window, rank):
            return True
        if last_batch:
            raise RuntimeError(
                f"rank {rank}'s train DataLoader ended inside window {window} of epoch {self.epoch} after "
                f"{batches} of {self.batches(window, rank)} batches: ElChe cannot close the window. Does the "
                "dataset's length change during the epoch?"
            )
        return False

    def boundary_due(self, next_window: int) -> bool:
        """Planned windows close only after a batch: never a second boundary in a row."""
        return False

    def trained_samples(self, window: int, rank: int) -> int:
        return self.sizes[window][rank]

    window_claim_ms = 0.0  # planned pieces are not claimed
    finished = False  # every rank closes every planned window after a batch of its own

    def window_closed(self) -> None:
        """Nothing to reset: the plan already knows every window's pieces."""

    def progress(self, window: int, rank: int, batches: int, units: int, share: float = 0.0) -> int:
        """Where ``batches`` into ``window`` stands on the window's ``units``: exact, never past its end
        (the rank's piece is known, so its expected ``share`` is not needed)."""
        return batches * units // self.batches(window, rank)

    def logged_units(self, window: int, automatic_optimization: bool) -> int:
        """Batches that step an optimizer in ``window``, all ranks: what Lightning's logger axis counts."""
        count = self.steps if automatic_optimization else self.batches
        return sum(count(window, rank) for rank in range(self.world_size))

    def batches(self, window: int, rank: int) -> int:
        return math.ceil(self.sizes[window][rank] / self.rank_batch_sizes[rank])

    def steps(self, window: int, rank: int) -> int:
        """Optimizer steps the window's piece makes in automatic optimization."""
        return math.ceil(self.sizes[window][rank] / self.samples_per_step)

    def steps_from(self, window: int) -> int:
        """Optimizer steps of all ranks in the frozen windows from ``window`` on."""
        return sum(self.steps(w, r) for w in range(window, len(self.sizes)) for r in range(self.world_size))

    def freeze(self, steps: Sequence[int]) -> None:
        """Fix the next window's pieces from the controller's per-rank step counts."""
        if self.complete:
            raise RuntimeError("the epoch plan is complete; no window can follow the final one")
        if len(steps) != self.world_size or min(steps) < 1:
            raise ValueError(f"need one step count >= 1 per rank, got {list(steps)}")
        request = [s * self.samples_per_step for s in steps]
        leftover = self.remaining - sum(request)
        if leftover < self.world_size * self.samples_per_step:
            request = self._final_split(request)
            self.complete = True
        offsets = []
        for size in request:
            offsets.append(self.cursor)
            self.cursor += size
        self.starts.append(offsets)
        self.sizes.append(request)
        self._windows_digest = digest(request, previous=self._windows_digest)

    def _final_split(self, request: list[int]) -> list[int]:
        """Split what remains in whole batches, in proportion to ``request``, one batch per rank at least.

        The tail of fewer than ``batch_size`` samples goes to the rank with the most batches, so
        at most one rank ends on a partial batch. A one-sample tail (which would break
        BatchNorm in training mode, and which DDP would not produce here) is avoided by
        splitting one full batch plus the tail into two partial batches on two ranks.
        """
        assert self.order is not None  # an epoch without an order never ends, so it has no final window
        size, remaining = self.batch_size, len(self.order) - self.cursor
        full, tail = divmod(remaining, size)
        if full < self.world_size:  # fewer batches than ranks: share samples, as evenly as weights allow
            return split_by_weights(remaining, request, minimum=1)
        sizes = [b * size for b in split_by_weights(full, request, minimum=1)]
        if tail == 0 or self.drop_last:  # with drop_last the tail is dropped, as DistributedSampler would
            return sizes
        by_size = sorted(range(self.world_size), key=lambda r: (-sizes[r], r))
        if tail > 1 or self.world_size == 1 or size < 3:
            sizes[by_size[0]] += tail
            return sizes
        larger, second = by_size[0], by_size[1]
        sizes[larger] += (size + 1) // 2 - size
        sizes[second] += (size + 1) - (size + 1) // 2
        return sizes

    def frozen_batches_after(self, window: int, rank: int) -> int:
        return sum(self.batches(w, rank) for w in range(window + 1, len(self.sizes)))

    def limit(self, steps_left: Optional[int]) -> None:
        """Nothing to cap up front: :meth:`open_windows` cuts each window to ``max_steps`` as it freezes it."""

    def open_windows(
        self, next_window: int, plan_steps: Callable[[], Sequence[int]], rank: int, lookahead_batches: int,
        window_cap: WindowCap,
    ) -> None:
        """Freeze the windows the DataLoader may reach before the boundary that closes ``next_window - 1``,
        each from the controller's counts (``plan_steps()``) cut so that the cohort lands on ``max_steps``
        and each milestone: ``window_cap(ahead)`` says how many steps a window may take with ``ahead``
        steps of windows frozen and not closed yet before it. Windows are frozen ahead of training, so
        those steps will all be taken."""
        if self.complete:
            return

        def cut() -> Sequence[int]:
            counts = list(plan_steps())
            allowed = window_cap(self.steps_from(next_window))
            if allowed is None or sum(counts) <= allowed:
                return counts
            return split_by_weights(max(allowed, self.world_size), counts, minimum=1)

        self.freeze_ahead(next_window, lookahead_batches, cut)

    def serve(self, rank: int, claiming: Claiming) -> Iterator[int]:
        """The sample indices this rank trains this epoch: its piece of each window, window after window
        (nothing is claimed: ``claiming`` is for dynamic dispatch)."""
        window = 0
        while True:
            if window >= len(self.sizes):
                if self.complete:
                    return
                raise RuntimeError(
                    f"ElChe sampler on rank {rank} reached window {window} of epoch {self.epoch} before "
                    "it was planned: the DataLoader prefetches further ahead than ElChe's lookahead "
                    "(a custom fetcher or batch sampler?). Please report this with your DataLoader settings."
                )
            yield from self.indices(window, rank).tolist()
            window += 1

    def freeze_ahead(self, next_window: int, lookahead_batches: int, plan_steps: Callable[[], Sequence[int]]) -> None:
        """Freeze windows until each rank has ``lookahead_batches`` decided beyond ``next_window``.

        ``next_window`` is the window about to be trained; the DataLoader may already pull
        ``lookahead_batches`` past its end before the boundary that closes it.
        """
        while not self.complete and not self._frozen_enough(next_window, lookahead_batches):
            self.freeze(plan_steps())

    def _frozen_enough(self, next_window: int, lookahead_batches: int) -> bool:
        """Whether every rank has ``lookahead_batches`` batches frozen beyond ``next_window``.

        Every window gives every rank at least one batch, so as many windows ahead as batches
        asked for is enough without counting per rank (which matters at thousands of ranks).
        """
        ahead = len(self.sizes) - next_window - 1
        if ahead < 0:
            return False
        if ahead >= lookahead_batches:
            return True
        return min(self.frozen_batches_after(next_window, r) for r in range(self.world_size)) >= lookahead_batches

    def covered_at(self, closed_windows: int, all_claims: Callable[[Claims], list[Claims]]) -> Spans:
        """The positions trained once ``closed_windows`` are closed (every rank knows the pieces: no gather)."""
        return self.covered(closed_windows)

    def claims(self) -> None:
        """Nothing is claimed: every rank knows every rank's pieces."""
        return None

    def trained_in_window(self) -> list[int]:
        """Nothing to tell: the window's pieces are known to every rank."""
        return []

    def covered_after_loss(
        self, closed_windows: int, survivors: Sequence[int], at_boundary: Sequence[Claims], trained_since: Sequence[int]
    ) -> Spans:
        """The positions trained once the ``survivors`` of a lost rank average window ``closed_windows``:
        every closed window's pieces and the survivors' pieces of that window (the plan knows them all)."""
        assert self.order is not None  # an epoch without an order never loses samples
        done = sum(sum(sizes) for sizes in self.sizes[:closed_windows])
        pieces = [(self.starts[closed_windows][r], self.starts[closed_windows][r] + self.sizes[closed_windows][r])
                  for r in survivors]  # fmt: skip
        return self.order.covered(Spans.prefix(done).union(Spans(piece for piece in pieces if piece[1] > piece[0])))

    def covered(self, closed_windows: int) -> Spans:
        """The positions of the epoch's order trained once ``closed_windows`` windows are closed.

        Windows are laid out back to back along ``order``, so the covered samples are a prefix
        of it (plus whatever a resumed epoch had covered before).
        """
        assert self.order is not None
        done = sum(sum(sizes) for sizes in self.sizes[:closed_windows])
        return self.order.covered(Spans.prefix(done))

    def indices(self, window: int, rank: int) -> torch.Tensor:
        assert self.order is not None, "an epoch without an order hands out no samples"
        start = self.starts[window][rank]
        return self.order[start : start + self.sizes[window][rank]]

    def fingerprint(self) -> int:
        """A 24-bit integer (exact in float32) that differs when two ranks froze different windows:
        it covers the epoch and every window frozen so far, hashed as each one is frozen."""
        return to_field(digest(len(self.sizes), self.cursor, previous=self._windows_digest))

    def fingerprints(self) -> dict[str, float]:
        """What a boundary checks across ranks (``cohort/fingerprint.py``): the windows' fingerprint,
        and what the plan was built from (seed, length, batching, the epoch's order), hashed once."""
        return {"fingerprint": float(self.fingerprint()), **self._data_fields}


def prefetch_depth(num_workers: int, prefetch_factor: Optional[int]) -> int:
    """Batches the DataLoader and Lightning's fetcher may pull ahead of the batch in training."""
    workers_ahead = num_workers * (prefetch_factor or 2) if num_workers > 0 else 0
    return 1 + workers_ahead  # Lightning's one-batch prefetch, then the workers' queued index batches


@dataclass
class WindowClock:
    """One rank's progress through the current window."""

    plan: Optional[Epoch] = None
    window: int = 0
    batches: int = 0
    train_ms: float = 0.0
    mark_s: float = 0.0  # when the current stretch of training started

    def untouched(self, plan: Epoch, epoch: int) -> bool:
        """Whether ``plan`` is ``epoch``'s and this rank has not trained from it: Lightning pulled a batch
        from an iterator and dropped it for a new one (its fit loop's set-up under
        ``reload_dataloaders_every_n_epochs``). The same plan then serves the new iterator, with what the
        dropped one claimed first; a new plan would leave that claimed by nobody, never trained."""
        return self.plan is plan and plan.epoch == epoch and self.window == self.batches == 0
