"""The train DataLoader under ElChe: what the plan needs to know about it, and the sampler it gets.

Lightning hands every train DataLoader to ``ElCheStrategy.process_dataloader``; here it is checked
(a map-style dataset with Lightning's DistributedSampler to replace, a custom sampler or batch
sampler, a LitData StreamingDataset or a sharded iterable) and described as a
:class:`~lightning_elche.cohort.train_data.TrainData` for the cohort's epoch plan, and its sampler is
swapped for an :class:`ElCheSampler` that yields this rank's pieces of the plan.
"""

from __future__ import annotations

import functools
import random
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from lightning_elche.cohort.claims import NO_CLAIMS, Claiming
from lightning_elche.cohort.epoch import Epoch
from lightning_elche.cohort.order import ENDLESS_POSITIONS
from lightning_elche.cohort.plan import prefetch_depth
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.settings import MicroBatchSizes
from lightning_elche.lightning.shards import ShardItems, is_sharded_iterable, shard_list, shard_settings, shard_table
from lightning_elche.lightning.streaming import (
    SUPPORTED_FORMS,
    CombinedDraws,
    CombinedItems,
    ParallelItems,
    ParallelPositions,
    StreamingItems,
    chunk_table,
    is_combined_streaming_dataset,
    is_parallel_streaming_dataset,
    is_remote,
    is_streaming_dataset,
    shuffle_block,
    streaming_seed,
)


def describe_train_loader(
    dataloader: object, accumulate_grad_batches: int, seed: Optional[int], endless_epoch: Optional[int] = None
) -> tuple[TrainData, int]:
    """The loader as the plan sees it, and how many batches it may pull ahead; refuses what cannot be split.
    ``endless_epoch``: the samples the fit trains (None: unknown), the epoch of a stream without end."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"ElCheStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
        )
    dataset = dataloader.dataset
    if is_streaming_dataset(dataset) or is_sharded_iterable(dataset):
        source = _chunked_source(dataloader, seed)
    elif is_combined_streaming_dataset(dataset):
        source = _combined_source(dataloader, seed)
    elif is_parallel_streaming_dataset(dataset):
        source = _parallel_source(dataloader, seed, endless_epoch)
    else:
        source = _map_source(dataloader, seed)
    batch_size = source.pop("batch_size", dataloader.batch_size)  # a batch sampler's: one unit per batch
    assert batch_size is not None  # every source refuses a loader without one
    data = TrainData(
        batch_size=batch_size,
        samples_per_step=batch_size * accumulate_grad_batches,
        drop_last=source.pop("drop_last", dataloader.drop_last),
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
    if not getattr(dataloader, "in_order", True):
        raise ValueError(
            "ElCheStrategy needs the train DataLoader to deliver batches in the order its sampler gave them: "
            "`in_order=False` lets workers return them out of order, so ElChe could not tell which samples a "
            "window trained (its coverage record, checkpoints and resume depend on it). Leave `in_order=True`"
        )
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler) is not BatchSampler:
        return _batch_units_source(dataloader.batch_sampler, seed)
    sampler = dataloader.sampler
    wrapped = _lightning.wrapped_sampler(sampler)
    if wrapped is not None:  # a custom sampler, which Lightning wrapped for DDP: the epoch's order is its draw
        custom, wrapper_seed = wrapped
        return {"num_samples": len(custom), "seed": wrapper_seed if seed is None else seed, "shuffle": False,
                "drawn": SamplerDraws(custom)}  # fmt: skip
    if type(sampler) is not DistributedSampler:
        raise ValueError(
            "ElCheStrategy partitions the training data itself and needs Lightning's DistributedSampler in "
            f"the train DataLoader, found {type(sampler).__name__}. Keep `Trainer(use_distributed_sampler=True)` "
            "and build the DataLoader with `shuffle=True/False` instead of a custom sampler."
        )
    return {
        "num_samples": len(sampler.dataset),  # type: ignore[arg-type]  # torch's Dataset type has no __len__
        "seed": sampler.seed if seed is None else seed,
        "shuffle": sampler.shuffle,
    }


def _batch_units_source(batches: Iterable[Sequence[int]], seed: Optional[int]) -> dict[str, Any]:
    """A custom batch sampler (length bucketing, say), which Lightning re-made around its DistributedSampler as
    under DDP: its batches over the whole epoch's order are the epoch's units, each handed out and trained
    whole (:class:`BatchUnits`)."""
    inner = getattr(batches, "sampler", None)
    wrapped = None if inner is None else _lightning.wrapped_sampler(inner)
    if wrapped is not None:  # the user's own sampler inside it: the epoch's order is its draw
        whole, inner_seed = wrapped
    elif type(inner) is DistributedSampler:
        whole = DistributedSampler(inner.dataset, num_replicas=1, rank=0, shuffle=inner.shuffle, seed=inner.seed)
        inner_seed = inner.seed
    else:
        raise ValueError(
            f"ElCheStrategy: the train batch_sampler {type(batches).__name__} has no `sampler` that Lightning "
            f"replaced (found {type(inner).__name__}): ElChe gives it the whole epoch's order through that "
            "attribute, as Lightning gives it each rank's under DDP. Take the sampler as an argument named "
            "`sampler` and keep it in `self.sampler`, as torch's BatchSampler does"
        )
    units = BatchUnits(batches, whole)
    seed = inner_seed if seed is None else seed
    return {"num_samples": len(units(0, seed)), "seed": seed, "shuffle": False, "units": units, "batch_size": 1,
            "drop_last": False}  # fmt: skip


def _chunked_source(dataloader: DataLoader, seed: Optional[int]) -> dict[str, Any]:
    """A LitData StreamingDataset (its chunk table, seed, shuffling, in-chunk shuffle block) or a sharded
    iterable (its shards as chunks read in order)."""
    dataset: Any = dataloader.dataset  # LitData's StreamingDataset is untyped
    _require_batch_size(dataloader)
    if is_sharded_iterable(dataset):
        chunks = shard_table(dataset)
        source = {"chunks": chunks, "sequential_chunks": True, **shard_settings(dataset, seed)}
    else:
        chunks = chunk_table(dataset)
        source = {"chunks": chunks, "seed": streaming_seed(dataset, seed), "shuffle": bool(dataset.shuffle),
                  "remote_chunks": is_remote(dataset)}  # fmt: skip
        source["chunk_block"] = shuffle_block(dataset)
    return {"num_samples": sum(end - start for start, end in chunks), **source}


def _require_batch_size(dataloader: DataLoader) -> None:
    """A streaming train dataset is split into steps by the DataLoader's batch size, which it must have."""
    if dataloader.batch_size is None:
        raise ValueError(
            f"ElCheStrategy needs the train DataLoader's `batch_size` to split a {type(dataloader.dataset).__name__} "
            "into steps; pass batch_size= to the DataLoader"
        )


def _combined_source(dataloader: DataLoader, seed: Optional[int]) -> dict[str, Any]:
    """A LitData CombinedStreamingDataset: its datasets' chunk tables one after the other, and its epochs'
    orders (:class:`~lightning_elche.lightning.streaming.CombinedDraws`; with ``weights`` an epoch ends
    where a dataset runs out, so the order is shorter than ``num_samples``, every item that can be drawn)."""
    datasets, combined_seed, weights, batching = _lightning.combined_streaming_parts(dataloader.dataset)
    _require_batch_size(dataloader)
    if any(not is_streaming_dataset(dataset) for dataset in datasets):
        raise ValueError("ElCheStrategy needs a CombinedStreamingDataset of LitData StreamingDatasets")
    tables = [chunk_table(dataset) for dataset in datasets]
    draws = CombinedDraws(
        tables, [bool(dataset.shuffle) for dataset in datasets], [shuffle_block(dataset) for dataset in datasets],
        dataloader.batch_size if batching == "per_stream" else None, weights,
    )  # fmt: skip
    return {"num_samples": sum(end - start for table in tables for start, end in table),
            "seed": combined_seed if seed is None else seed, "shuffle": False, "drawn": draws}  # fmt: skip


def _parallel_source(dataloader: DataLoader, seed: Optional[int], endless_epoch: Optional[int]) -> dict[str, Any]:
    """A LitData ParallelStreamingDataset: its epoch is ``length`` stream positions (the shortest dataset's
    length by default), in order (:class:`~lightning_elche.lightning.streaming.ParallelPositions`). An
    endless one (``length=float("inf")``, the stream going on across its datasets' cycles) has one epoch
    of the positions the fit trains, ``endless_epoch``: DDP's ranks, reading it until ``max_steps``, would
    together train the same. Without ``max_steps`` (a fit ended by ``max_time``, a stop, or nobody), its
    epoch is endless, as under DDP: ``ENDLESS_POSITIONS`` positions, handed out by speed like any."""
    parts = _lightning.parallel_streaming_parts(dataloader.dataset)
    _require_batch_size(dataloader)
    if any(not is_streaming_dataset(dataset) for dataset in parts.datasets):
        raise ValueError("ElCheStrategy needs a ParallelStreamingDataset of LitData StreamingDatasets")
    tables = [chunk_table(dataset) for dataset in parts.datasets]
    if parts.length == float("inf"):
        epoch_length = ENDLESS_POSITIONS if endless_epoch is None else endless_epoch
    elif parts.length is None:
        epoch_length = min(sum(end - start for start, end in table) for table in tables)  # the shortest dataset
    else:
        epoch_length = int(parts.length)
    return {"num_samples": epoch_length, "seed": parts.seed if seed is None else seed, "shuffle": False,
            "drawn": ParallelPositions(epoch_length, tables)}  # fmt: skip


def with_sampler(dataloader: DataLoader, data: TrainData, sampler: "ElCheSampler", batch_size: int) -> DataLoader:
    """The train DataLoader re-made around ElChe's sampler with this rank's ``batch_size`` (a streaming or
    sharded dataset as a map-style view)."""
    if data.sequential_chunks:
        assert data.chunks is not None
        return loader_over(dataloader, ShardItems(shard_list(dataloader.dataset), data.chunks), sampler, batch_size)
    if data.chunks is not None:
        return loader_over(dataloader, StreamingItems(dataloader.dataset, data.chunks), sampler, batch_size)
    if isinstance(data.drawn, CombinedDraws):
        datasets = _lightning.combined_streaming_parts(dataloader.dataset)[0]
        return loader_over(dataloader, CombinedItems(datasets, data.drawn.tables), sampler, batch_size)
    if isinstance(data.drawn, ParallelPositions):
        parts = _lightning.parallel_streaming_parts(dataloader.dataset)
        return loader_over(dataloader, ParallelItems(parts, data.drawn, data.seed), sampler, batch_size)
    if data.units is not None:
        return loader_over(dataloader, dataloader.dataset, batch_sampler=UnitBatches(sampler, data.units, data.seed))
    args: tuple[Any, ...]  # Lightning's annotation says a 1-tuple: it is the loader's saved arguments, any number
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler, mode=RunningStage.TRAINING)
    if batch_size != dataloader.batch_size:
        names = getattr(dataloader, "__pl_saved_arg_names", ())
        if "batch_size" in names[: len(args)]:
            args = tuple(batch_size if name == "batch_size" else arg for name, arg in zip(names, args))
        else:
            kwargs = {**kwargs, "batch_size": batch_size}  # a copy: these are the user loader's saved arguments
    loader = _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
    if loader.batch_size != batch_size:
        raise ValueError(
            f"ElCheStrategy(micro_batch_sizes=...): this rank's train DataLoader ({type(dataloader).__name__}) "
            f"was re-made with batch_size={batch_size} but has {loader.batch_size}: it sets its own. Let its "
            "batch_size come from its __init__ argument, or leave micro_batch_sizes=None"
        )
    return loader


def rank_batch_sizes(
    micro_batch_sizes: MicroBatchSizes, members: Sequence[int], batch_size: int, fixed: bool = True
) -> tuple[int, ...]:
    """Every rank's DataLoader batch under ``micro_batch_sizes``, for the ranks whose member ids are
    ``members`` in rank order (a fixed world's are its ranks): sizes are keyed by member id, a list giving
    the launch's members 0, 1, ... and the ids it does not name keeping ``batch_size`` (an elastic
    cohort's joiners and spares, unless a mapping names their ids). Each must divide ``batch_size``, so
    that a step is the same whole number of batches on every rank."""
    world_size = len(members)
    if isinstance(micro_batch_sizes, Mapping):
        named = dict(micro_batch_sizes)
        stray = sorted(rank for rank in named if rank >= world_size)
        if stray and fixed:
            raise ValueError(
                f"ElCheStrategy: `micro_batch_sizes` names rank(s) {stray}, but this fit has {world_size} "
                f"ranks (0 to {world_size - 1})"
            )
    else:
        if len(micro_batch_sizes) != world_size and fixed:
            raise ValueError(
                f"ElCheStrategy: `micro_batch_sizes` has {len(micro_batch_sizes)} entries for {world_size} ranks: "
                "give one per rank, or a mapping {global rank: size} for the ranks that differ"
            )
        named = dict(enumerate(micro_batch_sizes))
    sizes = tuple(named.get(member, batch_size) for member in members)
    wrong = {rank: size for rank, size in enumerate(sizes) if batch_size % size}
    if wrong:
        raise ValueError(
            f"ElCheStrategy: `micro_batch_sizes` must divide the train DataLoader's batch_size ({batch_size}), "
            f"so that every rank's step sees the same samples; {wrong} do not. Divisors of {batch_size}: "
            f"{[d for d in range(1, batch_size + 1) if batch_size % d == 0]}"
        )
    return sizes


def reading_lanes(dataloader: DataLoader, data: TrainData, batch_size: int) -> int:
    """Lanes for the sampler's claims: one per DataLoader worker where whole chunks are claimed (shards
    read in order, remote chunks) and a step is one batch (workers get batches in turn, so each reads
    its lane's chunks: forward, or downloading each once); else one. With gradient accumulation a step's
    batches go to several workers, which then each read the chunks they share."""
    if data.claims_whole_chunks and data.samples_per_step == batch_size:
        return max(1, dataloader.num_workers)
    return 1


def loader_over(
    dataloader: DataLoader, items: Dataset, sampler: Optional[Sampler[int]] = None, batch_size: Optional[int] = None,
    batch_sampler: Optional[Sampler[list[int]]] = None,
) -> DataLoader:
    """A torch DataLoader over ``items`` with ``sampler`` and ``batch_size`` (or a ``batch_sampler``) and
    everything else the user's loader had."""
    workers = dataloader.num_workers
    batching: dict[str, Any] = (
        {"batch_sampler": batch_sampler} if batch_sampler is not None
        else {"batch_size": batch_size, "sampler": sampler, "drop_last": dataloader.drop_last}
    )
    return DataLoader(
        items,
        **batching,
        num_workers=workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        prefetch_factor=dataloader.prefetch_factor if workers > 0 else None,
        persistent_workers=dataloader.persistent_workers and workers > 0,
        pin_memory_device=dataloader.pin_memory_device,
    )


class SamplerDraws:
    """A custom train sampler's draw of each epoch (a ``WeightedRandomSampler``, a class-balanced or
    curriculum sampler), the same on every rank and again when a run resumes, as DistributedSampler's
    shuffle is: drawn with ``seed + epoch`` in torch's and Python's global generators (forked for the
    draw) and in the sampler's own ``generator`` attribute if it has one (replaced for the draw), after
    its ``set_epoch(epoch)`` if it has one. The last draw is kept: the plan reads an epoch's order
    several times. A rank that still draws differently is caught at the first boundary (the plans'
    fingerprints), a resume that does by the checkpoint's digest of the draw."""

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self._last_draw = functools.lru_cache(maxsize=1)(self._draw)

    def __call__(self, epoch: int, seed: int) -> torch.Tensor:
        return self._last_draw(epoch, seed)

    def _draw(self, epoch: int, seed: int) -> torch.Tensor:
        sampler = self.sampler
        with seeded_for_epoch([sampler], epoch, seed):
            drawn = list(sampler)
        if not all(isinstance(index, int) for index in drawn):
            raise ValueError(
                f"ElCheStrategy: the train sampler {type(sampler).__name__} yields {type(drawn[0]).__name__}, not "
                "dataset indices; a sampler of whole batches belongs in the DataLoader's `batch_sampler`"
            )
        return torch.tensor(drawn, dtype=torch.long)


@contextmanager
def seeded_for_epoch(samplers: Sequence[object], epoch: int, seed: int) -> Iterator[None]:
    """Draw ``samplers`` as DistributedSampler shuffles, the same on every rank and on resume: each gets
    ``set_epoch(epoch)`` if it has one, its ``generator`` attribute (if any) is replaced by one seeded with
    ``seed + epoch``, and so are torch's and Python's global generators (forked: the user's stay untouched)."""
    seeded = seed + epoch
    for sampler in samplers:
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    own = [(sampler, sampler.generator) for sampler in samplers if hasattr(sampler, "generator")]
    python_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeded)
            random.seed(seeded)
            for sampler, _ in own:
                sampler.generator = torch.Generator().manual_seed(seeded)
            yield
    finally:
        random.setstate(python_state)
        for sampler, generator in own:
            sampler.generator = generator


class BatchUnits:
    """A custom batch sampler's batches of each epoch (bucketing by length, say), drawn over the whole epoch's
    order: the epoch's units, each handed out and trained whole, so the sampler's batches (its buckets) stay
    as it made them. Its inner sampler is replaced for the draw by ``whole`` (the epoch's full order, where
    under DDP Lightning gives it each rank's share), and the draw is seeded per epoch
    (:func:`seeded_for_epoch`), so every rank and a resumed run get the same batches. The last draw is kept."""

    def __init__(self, batches: Iterable[Sequence[int]], whole: Sampler[int]) -> None:
        self.batches, self.whole = batches, whole
        self._last_draw = functools.lru_cache(maxsize=1)(self._draw)

    def __call__(self, epoch: int, seed: int) -> tuple[tuple[int, ...], ...]:
        return self._last_draw(epoch, seed)

    def _draw(self, epoch: int, seed: int) -> tuple[tuple[int, ...], ...]:
        batches, whole = self.batches, self.whole
        if isinstance(whole, DistributedSampler):
            whole.seed = seed
        own = batches.sampler  # type: ignore[attr-defined]  # _batch_units_source checked it has one
        batches.sampler = whole  # type: ignore[attr-defined]
        try:
            with seeded_for_epoch([whole, batches], epoch, seed):
                return tuple(tuple(int(index) for index in batch) for batch in batches)
        finally:
            batches.sampler = own  # type: ignore[attr-defined]


class UnitBatches(Sampler[list[int]]):
    """The train DataLoader's batch sampler for a batch sampler's units: each unit :class:`ElCheSampler`
    hands this rank (planned or claimed) becomes the batch it stands for. The units' sampler is its
    ``sampler``, where Lightning looks for a batch sampler's to call ``set_epoch`` on."""

    def __init__(self, sampler: "ElCheSampler", batches: Callable[[int, int], Sequence[Sequence[int]]], seed: int) -> None:
        self.sampler, self.batches, self.seed = sampler, batches, seed

    def __iter__(self) -> Iterator[list[int]]:
        for unit in self.sampler:
            yield list(self.batches(self.sampler.serving, self.seed)[unit])


class ElCheSampler(Sampler[int]):
    """Yields this rank's pieces of the current epoch: its planned pieces window after window, or
    the tickets it claims from the epoch's pool (dynamic dispatch); the epoch decides which
    (:meth:`~lightning_elche.cohort.epoch.Epoch.serve`).

    ``begin_epoch(epoch)`` is provided by the strategy: it builds the epoch's plan from the
    replicated controller state and opens the first windows. Iteration happens in the main
    process (also with ``num_workers > 0``), so the plan it reads is the one the boundaries extend.
    ``claiming`` says how dynamic dispatch claims (:class:`~lightning_elche.cohort.pool.Claiming`).
    """

    def __init__(
        self, begin_epoch: Callable[[int], Epoch], rank: int, epoch: int = 0, claiming: Claiming = NO_CLAIMS
    ) -> None:
        self._begin_epoch = begin_epoch
        self.rank = rank
        self.epoch = epoch
        self.serving = epoch
        self.claiming = claiming

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rebind(self, begin_epoch: Callable[[int], Epoch], rank: int, claiming: Claiming) -> None:
        """Serve another cohort (an elastic fit's next generation) from the next iterator on."""
        self._begin_epoch, self.rank, self.claiming = begin_epoch, rank, claiming

    def __iter__(self) -> Iterator[int]:
        epoch = self._begin_epoch(self.epoch)
        self.serving = epoch.epoch  # the epoch the plan serves (a resumed epoch closed by its checkpoint: the next)
        return epoch.serve(self.rank, self.claiming)
