"""The train DataLoader under ElChe: what the plan needs to know about it, and the sampler it gets.

Lightning hands every train DataLoader to ``ElCheStrategy.process_dataloader``; here it is checked
(a map-style dataset with Lightning's DistributedSampler to replace, or a LitData
StreamingDataset; a ``batch_size``) and described as a
:class:`~lightning_elche.cohort.plan.TrainData` for the cohort's epoch plan, and its sampler is
swapped for an :class:`ElCheSampler` that yields this rank's pieces of the plan.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterator, Optional

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_elche.cohort.plan import Epoch, EpochPlan, TrainData, prefetch_depth
from lightning_elche.cohort.pool import PoolEpoch
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.lightning.streaming import (
    SUPPORTED_FORMS, StreamingItems, chunk_table, is_streaming_dataset, shuffle_block, streaming_loader,
    streaming_seed,
)


def describe_train_loader(
    dataloader: object, accumulate_grad_batches: int, seed: Optional[int]
) -> tuple[TrainData, int]:
    """The loader as the plan sees it, and how many batches it may pull ahead; refuses what cannot be split."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"ElCheStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
        )
    dataset = dataloader.dataset
    source = _streaming_source(dataloader, seed) if is_streaming_dataset(dataset) else _map_source(dataloader, seed)
    assert dataloader.batch_size is not None  # both sources refuse a loader without one
    data = TrainData(
        batch_size=dataloader.batch_size,
        samples_per_step=dataloader.batch_size * accumulate_grad_batches,
        drop_last=dataloader.drop_last,
        **source,
    )
    return data, prefetch_depth(dataloader.num_workers, dataloader.prefetch_factor)


def _map_source(dataloader: DataLoader, seed: Optional[int]) -> dict[str, Any]:
    """A map-style dataset behind Lightning's DistributedSampler: its length, seed and shuffling."""
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"ElCheStrategy gives each rank a share of the training samples by index, which this IterableDataset "
            f"({type(dataset).__name__}) does not have. Use {SUPPORTED_FORMS} for training, or strategy='ddp'"
        )
    if dataloader.batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
        raise ValueError(
            "ElCheStrategy needs the train DataLoader's `batch_size` (a custom `batch_sampler` cannot be split "
            "into windows); pass batch_size= to the DataLoader instead of a batch_sampler"
        )
    if not getattr(dataloader, "in_order", True):
        raise ValueError(
            "ElCheStrategy needs the train DataLoader to deliver batches in the order its sampler gave them: "
            "`in_order=False` lets workers return them out of order, so ElChe could not tell which samples a "
            "window trained (its coverage record, checkpoints and resume depend on it). Leave `in_order=True`"
        )
    sampler = dataloader.sampler
    if type(sampler) is not DistributedSampler:
        raise ValueError(
            "ElCheStrategy partitions the training data itself and needs Lightning's DistributedSampler in "
            f"the train DataLoader, found {type(sampler).__name__}. Keep `Trainer(use_distributed_sampler=True)` "
            "and build the DataLoader with `shuffle=True/False` instead of a custom sampler."
        )
    return {
        "num_samples": len(sampler.dataset),  # type: ignore[arg-type]
        "seed": sampler.seed if seed is None else seed,
        "shuffle": sampler.shuffle,
    }


def _streaming_source(dataloader: DataLoader, seed: Optional[int]) -> dict[str, Any]:
    """A LitData StreamingDataset: its chunk table, seed, shuffling and in-chunk shuffle block."""
    if dataloader.batch_size is None:
        raise ValueError(
            "ElCheStrategy needs the train DataLoader's `batch_size` to split a StreamingDataset into steps; pass "
            "batch_size= to the StreamingDataLoader"
        )
    dataset = dataloader.dataset
    chunks = chunk_table(dataset)
    return {
        "num_samples": sum(end - start for start, end in chunks),
        "seed": streaming_seed(dataset, seed),
        "shuffle": bool(dataset.shuffle),
        "chunks": chunks,
        "chunk_block": shuffle_block(dataset),
    }


def with_sampler(dataloader: DataLoader, data: TrainData, sampler: "ElCheSampler") -> DataLoader:
    """The train DataLoader re-made around ElChe's sampler (a StreamingDataset's as a map-style view)."""
    if data.chunks is not None:
        return streaming_loader(dataloader, StreamingItems(dataloader.dataset, data.chunks), sampler)
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


class ElCheSampler(Sampler[int]):
    """Yields this rank's pieces of the current epoch: its planned pieces window after window, or
    the tickets it claims from the epoch's pool (dynamic dispatch).

    ``begin_epoch(epoch)`` is provided by the strategy: it builds the epoch's plan from the
    replicated controller state and opens the first windows. Iteration happens in the main
    process (also with ``num_workers > 0``), so the plan it reads is the one the boundaries extend.
    ``counter`` claims tickets in the store, ``chunk(round_trip_ms)`` of them at a time, each claim
    inside ``claiming()`` (the strategy's: a store whose host died is named, not a bare socket error).
    """

    def __init__(
        self,
        begin_epoch: Callable[[int], Epoch],
        rank: int,
        epoch: int = 0,
        counter: Optional[TicketCounter] = None,
        chunk: Callable[[float], int] = lambda round_trip_ms: 1,
        claiming: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self._begin_epoch = begin_epoch
        self.rank = rank
        self.epoch = epoch
        self._counter = counter
        self._chunk = chunk
        self._claiming = claiming

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        plan = self._begin_epoch(self.epoch)
        if isinstance(plan, PoolEpoch):
            return self._claim(plan)
        return self._walk(plan)

    def _claim(self, pool: PoolEpoch) -> Iterator[int]:
        counter = self._counter
        if counter is None:
            raise RuntimeError("ElChe's dynamic dispatch needs the rendezvous store's counter, which was not set up")
        tickets = pool.took(self.rank, 1)  # the reserved ticket
        while tickets:
            for ticket in tickets:
                yield from pool.ticket_indices(ticket).tolist()
            if pool.leaves_the_rest():
                return
            count = self._chunk(counter.round_trip_ms)
            with self._claiming():
                first = counter.claim(pool.epoch, count)
            tickets = pool.took(first, count, counter.last_ms)

    def _walk(self, plan: EpochPlan) -> Iterator[int]:
        window = 0
        while True:
            if window >= len(plan.sizes):
                if plan.complete:
                    return
                raise RuntimeError(
                    f"ElChe sampler on rank {self.rank} reached window {window} of epoch {plan.epoch} before "
                    "it was planned: the DataLoader prefetches further ahead than ElChe's lookahead "
                    "(a custom fetcher or batch sampler?). Please report this with your DataLoader settings."
                )
            yield from plan.indices(window, self.rank).tolist()
            window += 1
