"""The train DataLoader as the epoch's plan sees it, identical on every rank.

:class:`TrainData` says what an epoch's order is made of (a map-style dataset's length and seed, a
streaming dataset's chunks, a custom sampler's draw, a custom batch sampler's batches), how it is batched, and what
``limit_train_batches`` leaves of it; :meth:`TrainData.plan` builds each epoch's dispatch from it (a
planned :class:`~lightning_elche.cohort.plan.EpochPlan` or a dynamic
:class:`~lightning_elche.cohort.pool.PoolEpoch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.epoch import Epoch
from lightning_elche.cohort.limits import ddp_batches_per_rank
from lightning_elche.cohort.order import (
    BaseOrder,
    ChunkedOrder,
    EpochOrder,
    concatenate,
    epoch_order,
    order_digest,
    tensor_digest,
)
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.cohort.pool import PoolEpoch


@dataclass(frozen=True)
class TrainData:
    """What the plan needs to know about the train DataLoader; identical on every rank."""

    num_samples: Optional[int]  # None: an endless stream of steps (the simulator's epoch-less runs)
    seed: int
    shuffle: bool
    batch_size: int
    samples_per_step: int  # batch size x gradient-accumulation batches
    drop_last: bool
    chunks: Optional[tuple[tuple[int, int], ...]] = None  # a streaming dataset's chunks (order.ChunkedOrder)
    chunk_block: int = 0  # items shuffled together inside a chunk (order.ChunkedOrder's block)
    sequential_chunks: bool = False  # chunks read in order only (a sharded iterable's shards): claimed whole
    remote_chunks: bool = False  # chunks downloaded from remote storage (LitData's s3://...): claimed whole
    # Each rank's own DataLoader batch (``micro_batch_sizes``), dividing ``batch_size``; None: ``batch_size``
    # everywhere. Steps stay ``samples_per_step`` samples on every rank, so only batch counts change.
    rank_batch_sizes: Optional[tuple[int, ...]] = None
    # ``Trainer(limit_train_batches)`` (None: the whole epoch): the epoch trains as many samples as DDP's
    # ranks would together, the first ones of its order, split by speed like any other epoch.
    batch_limit: Optional[Union[int, float]] = None
    # A custom sampler's draw of an epoch, ``drawn(epoch, seed)`` (the adapter's, which runs the user's
    # sampler seeded per epoch): the epoch's order is its output, ``num_samples`` long, repeats and all
    # (an endless stream's: its positions, a lazy range).
    drawn: Optional[Callable[[int, int], BaseOrder]] = field(default=None, compare=False)
    # A custom batch sampler's batches of an epoch, ``units(epoch, seed)`` (a bucketing sampler's, say): each
    # batch is one unit of the order, handed out and trained whole, so ``batch_size`` is 1 (a unit per batch)
    # and ``num_samples`` counts batches. The order is the batches as the sampler yields them.
    units: Optional[Callable[[int, int], Sequence[Sequence[int]]]] = field(default=None, compare=False)

    def ddp_batches(self, world_size: int) -> int:
        """Batches each rank would run per epoch under DDP, ``limit_train_batches`` applied (as
        Lightning applies it: an int caps the count, a fraction keeps that part of it, rounded down)."""
        assert self.num_samples is not None
        batches = ddp_batches_per_rank(self.num_samples, world_size, self.batch_size, self.drop_last)
        limit = self.batch_limit
        if limit is None:
            return batches
        return min(batches, limit) if isinstance(limit, int) else int(batches * limit)

    def epoch_samples(self, world_size: int) -> int:
        """Samples of each epoch's order that are trained: all, or what ``limit_train_batches`` leaves."""
        assert self.num_samples is not None
        if self.batch_limit is None:
            return self.num_samples
        return min(self.num_samples, world_size * self.ddp_batches(world_size) * self.batch_size)

    @property
    def claims_whole_chunks(self) -> bool:
        """Whether dynamic dispatch hands out whole chunks: a shard that can only be read forward, or a
        remote chunk, which then only the rank that claimed it downloads."""
        return self.sequential_chunks or self.remote_chunks

    @property
    def accumulation(self) -> int:
        """DDP's batches per optimizer step (``accumulate_grad_batches``)."""
        return self.samples_per_step // self.batch_size

    def rank_batch_size(self, rank: int) -> int:
        """``rank``'s DataLoader batch."""
        return self.batch_size if self.rank_batch_sizes is None else self.rank_batch_sizes[rank]

    def base_order(self, epoch: int, seed: Optional[int] = None) -> BaseOrder:
        """The epoch's full order (with another ``seed``: the order a checkpoint was written in)."""
        assert self.num_samples is not None
        seed = self.seed if seed is None else seed
        if self.chunks is not None:
            return ChunkedOrder(self.chunks, seed, epoch, self.shuffle, self.chunk_block, self.sequential_chunks)
        if self.drawn is not None:
            return self.drawn(epoch, seed)
        if self.units is not None:
            return torch.arange(self._unit_count(epoch, seed))
        return epoch_order(self.num_samples, seed, epoch, self.shuffle)

    def _unit_count(self, epoch: int, seed: int) -> int:
        assert self.units is not None
        count = len(self.units(epoch, seed))
        if count != self.num_samples:
            raise ValueError(
                f"ElCheStrategy: the train batch_sampler made {count} batches in epoch {epoch} and {self.num_samples} "
                "in the fit's first: ElChe plans each epoch's batches as its units and needs as many every epoch "
                "(a bucketing sampler whose partial batches vary with the shuffle: drop them, drop_last=True)"
            )
        return count

    def drawn_digest(self, epoch: int) -> Optional[str]:
        """A custom sampler's draw (or batch sampler's batches) of ``epoch``, hashed (None: the order is
        ElChe's own, replayed from the seed)."""
        if self.units is not None:
            batches = self.units(epoch, self.seed)
            return tensor_digest(torch.tensor([len(batch) for batch in batches] + [i for b in batches for i in b])).hex()
        return None if self.drawn is None else order_digest(self.drawn(epoch, self.seed)).hex()

    def samples_at(self, epoch: int, positions: Spans) -> torch.Tensor:
        """The sample indices at ``positions`` of the epoch's order (what a checkpoint's coverage names)."""
        if self.units is not None:
            batches = self.units(epoch, self.seed)
            return torch.tensor([i for start, end in positions for batch in batches[start:end] for i in batch])
        base = self.base_order(epoch)
        return concatenate([base[start:end] for start, end in positions])

    def plan(
        self,
        epoch: int,
        world_size: int,
        covered: Optional[Union[Spans, torch.Tensor]] = None,
        dynamic: bool = False,
        covered_seed: Optional[int] = None,
    ) -> Epoch:
        """The epoch's plan; with ``covered`` (a resumed epoch), only the samples not trained yet, in epoch order.

        ``covered``: the positions of the epoch's order trained before (spans, in the order of
        ``covered_seed``, default this seed), or a bool mask over dataset indices (schema-1 checkpoints).
        ``dynamic``: a pool of tickets the ranks claim (``pool.py``; whole chunks of them where
        :attr:`claims_whole_chunks`), unless the epoch has fewer than there are ranks (a tiny set, the tail
        of a resumed epoch): that one is planned.
        """
        if self.num_samples is None:
            return EpochPlan(
                epoch, None, world_size, self.batch_size, self.samples_per_step, self.drop_last,
                rank_batch_sizes=self.rank_batch_sizes,
            )  # fmt: skip
        base = self.base_order(epoch)
        untrained = Spans.prefix(len(base)) if covered is None else self._left_to_train(epoch, base, covered, covered_seed)
        left = untrained.intersect(Spans.prefix(self.epoch_samples(world_size)))
        order = EpochOrder(base, left, trained_before=untrained.complement(len(base)))
        if dynamic and PoolEpoch.serves(len(order), world_size, self.batch_size, self.samples_per_step, self.drop_last):
            pool = PoolEpoch(epoch, order, world_size, self, order.chunk_starts() if self.claims_whole_chunks else None)
            if pool.claim_units >= world_size:
                return pool
        return EpochPlan(
            epoch, order, world_size, self.batch_size, self.samples_per_step, self.drop_last,
            num_samples=self.num_samples, seed=self.seed, shuffle=self.shuffle, rank_batch_sizes=self.rank_batch_sizes,
        )

    def _left_to_train(
        self, epoch: int, base: BaseOrder, covered: Union[Spans, torch.Tensor], covered_seed: Optional[int]
    ) -> Spans:
        """The positions of ``base`` not trained yet. Spans in this seed's order need nothing per sample;
        a mask, or spans in another seed's order, are mapped through both orders once."""
        if isinstance(covered, Spans):
            if covered_seed is None or covered_seed == self.seed:
                return covered.complement(len(base))
            trained, then = torch.zeros(len(base), dtype=torch.bool), self.base_order(epoch, covered_seed)
            for start, end in covered:
                trained[then[start:end]] = True
            covered = trained
        return Spans.of_positions(torch.nonzero(~covered[base[0 : len(base)]]).flatten())
