"""Validation loaders split by speed (``cohort/validation.py`` decides the shares).

Lightning gives a validation DataLoader its DistributedSampler: equal shares, padded. When that is
all the loader has (a map-style dataset, no shuffling, a plain batch size), :func:`split_by_speed`
re-makes it around :class:`SpeedSplitBatches`, which takes the cohort's speeds each time validation
starts, so the split follows the ranks as they are at that boundary. Anything else (a custom
sampler or batch sampler, ``limit_val_batches`` other than the whole set, an iterable) keeps
Lightning's sampler, as under DDP.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional, Sequence

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_elche.cohort.limits import ddp_batches_per_rank
from lightning_elche.cohort.validation import even_batches, speed_counts
from lightning_elche.lightning.data import loader_over


class ValidationSplit:
    """Whether the fit's validation may be split by speed, and the ranks' validation speeds.

    Not before a first validation ran with equal batch counts (a probe); never once a collective was called
    between validation steps there or later (a metric logged with ``sync_dist=True`` on every step): ranks
    with unequal batch counts would call it unequally often and wait for each other forever. Every rank sees
    the same collectives, so all decide alike. Each rank times its own validation (``local_ms``, ms per
    sample, between its batches' starts: :meth:`clock_stopped`) and reports it at the next boundary; every
    rank then has everybody's (``rank_ms``, from the boundary's control data, so the same on every rank),
    which the next validation's shares follow."""

    def __init__(self) -> None:
        self.probed = False
        self.per_step_collectives = False
        self.local_ms = 0.0
        self.rank_ms: list[Optional[float]] = []
        self._first_start: Optional[float] = None  # this validation's first batch start (perf_counter)
        self._last_start = 0.0  # and its latest one
        self._starts = 0  # batches started this validation
        self._sizes: list[int] = []  # the samples of each split batch handed out, in order

    def clock_started(self) -> None:
        """A validation starts (the callback's hook, sanity checks aside)."""
        self._first_start, self._starts, self._sizes = None, 0, []

    def batch_started(self) -> None:
        """A validation batch starts (the callback's hook, first among the callbacks): the previous one,
        with every hook of every callback (a slowed rank's stretch included), is over."""
        now = time.perf_counter()
        if self._first_start is None:
            self._first_start = now
        self._last_start, self._starts = now, self._starts + 1

    def served(self, sizes: Sequence[int]) -> None:
        """A split loader handed out all its batches, of ``sizes`` samples."""
        self._sizes.extend(sizes)

    def clock_stopped(self) -> None:
        """The validation's batches ran: ``local_ms`` is the time from its first batch's start to its last
        one's over the samples of the batches in between (all but the last), measured where every batch
        came from a split loader. Not later: Lightning reduces the logged metrics before the epoch-end
        hooks, where this rank would wait for the others; not by the sampler's clock, stopped when the
        loader's prefetch asks past the last batch, which missed a batch's time and so favoured the rank
        with fewer batches (the slow one)."""
        if self._first_start is not None and self._starts >= 2 and len(self._sizes) == self._starts:
            self.local_ms = (self._last_start - self._first_start) * 1000.0 / sum(self._sizes[:-1])
        self._first_start = None

    @property
    def by_speed(self) -> bool:
        return self.probed and not self.per_step_collectives

    def observe(self, rank_ms: Sequence[float]) -> None:
        """A boundary's control data: every rank's ms per validation sample (0 where it has not validated)."""
        if all(ms > 0 for ms in rank_ms):
            self.rank_ms = list(rank_ms)

    def ms_per_sample(self, training_ms_per_step: Sequence[Optional[float]]) -> Sequence[Optional[float]]:
        """The ranks' validation speeds when measured, else their training speeds (the same ratios on
        hardware that is slower as a whole)."""
        return self.rank_ms if len(self.rank_ms) == len(training_ms_per_step) else training_ms_per_step


class SpeedSplitBatches(Sampler[list[int]]):
    """This rank's validation batches: a contiguous share of the set, proportional to its speed once
    ``split.by_speed`` (equal shares in DDP's number of batches before), the shares taken anew at every
    validation; it tells ``split`` what it served (which times the validation). It has no length: the
    number of batches changes with the ranks' speeds."""

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int,
        ms_per_step: Callable[[], Sequence[Optional[float]]], split: ValidationSplit,
    ) -> None:
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.ms_per_step, self.split = ms_per_step, split

    def __iter__(self) -> Iterator[list[int]]:
        by_speed, size = self.split.by_speed, self.batch_size
        ms = self.split.ms_per_sample(self.ms_per_step()) if by_speed else [None] * self.world_size
        counts = speed_counts(self.num_samples, self.world_size, ms)
        mine = counts[self.rank]
        sizes = (
            [min(size, mine - start) for start in range(0, mine, size)] if by_speed
            else even_batches(mine, ddp_batches_per_rank(self.num_samples, self.world_size, size, drop_last=False))
        )
        start = sum(counts[: self.rank])
        for size in sizes:
            yield list(range(start, start + size))
            start += size
        self.split.probed = True  # every batch handed out (the sanity check's few leave the probe to come)
        self.split.served(sizes)


def split_by_speed(
    dataloader: object, rank: int, world_size: int, ms_per_step: Callable[[], Sequence[Optional[float]]],
    split: ValidationSplit, whole_set: bool,
) -> object:
    """``dataloader`` re-made around :class:`SpeedSplitBatches` when it is Lightning's plain split of a
    map-style set (``whole_set``: ``limit_val_batches`` validates all of it); else unchanged."""
    if not (whole_set and isinstance(dataloader, DataLoader) and world_size > 1):
        return dataloader
    sampler, batches = dataloader.sampler, dataloader.batch_sampler
    plain = (
        type(sampler) is DistributedSampler and not sampler.shuffle and not sampler.drop_last
        and type(batches) is BatchSampler and not dataloader.drop_last
        and not isinstance(dataloader.dataset, IterableDataset) and dataloader.batch_size is not None
    )  # fmt: skip
    if not plain:
        return dataloader
    assert isinstance(sampler, DistributedSampler) and dataloader.batch_size is not None
    size = len(sampler.dataset)  # type: ignore[arg-type]  # a map-style set: sized
    split_batches = SpeedSplitBatches(size, dataloader.batch_size, rank, world_size, ms_per_step, split)
    return loader_over(dataloader, dataloader.dataset, batch_sampler=split_batches)
