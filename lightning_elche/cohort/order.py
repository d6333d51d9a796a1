"""An epoch's order of samples, and the part of it left to train.

Map-style datasets keep their order as a tensor: one seeded permutation of the dataset's indices
per epoch (the same on every rank, whatever the world size). A streaming dataset is stored in
chunks, read a chunk at a time, and may hold 10^7 items or more: its order is never materialised.
:class:`ChunkedOrder` permutes the chunks, then the items inside each chunk, and computes any
slice of positions on demand, so what a rank holds is the chunk table (two ints per chunk) and the
in-chunk permutation of the chunk it is reading. Consecutive positions stay in one chunk, and
inside a chunk in one block of ``block`` items (the blocks permuted, then the items of each
block), as LitData's own shuffle does (its ``item_shuffle_window``): LitData decodes aligned
windows of rows and keeps the last one, and this keeps reads as local as under its own loader.

:class:`EpochOrder` is what the plans read: the base order restricted to the positions still to
train (all of them, or what a resumed checkpoint left), renumbered from 0. Coverage is recorded
in the base order's positions (``coverage.py``), so it means the same at any world size.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from typing import Optional, Sequence, Union

import torch

from lightning_elche.cohort.coverage import Spans, Subsequence
from lightning_elche.cohort.fingerprint import digest


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """A map-style dataset's epoch order, identical on every rank."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


class ChunkedOrder:
    """A streaming dataset's epoch order over chunks of items, computed slice by slice.

    ``chunks`` are ``(first_item, end_item)`` ranges of global item indices, one per chunk, in the
    dataset's chunk order. With ``shuffle`` the chunks are permuted with ``(seed, epoch)``, and
    inside each chunk its blocks of ``block`` items (0: one block) and their items with
    ``(seed, epoch, chunk)``, unless ``sequential`` (chunks that can only be read in order: a
    sharded iterable's shards); without ``shuffle`` the order is the items' own.
    """

    def __init__(
        self,
        chunks: Sequence[tuple[int, int]],
        seed: int,
        epoch: int,
        shuffle: bool,
        block: int = 0,
        sequential: bool = False,
    ) -> None:
        self.seed, self.epoch, self.shuffle, self.block, self.sequential = seed, epoch, shuffle, block, sequential
        self._chunks = [(int(start), int(end)) for start, end in chunks]
        if shuffle:
            generator = torch.Generator().manual_seed(_mix(seed, epoch))
            self._sequence: list[int] = torch.randperm(len(self._chunks), generator=generator).tolist()
        else:
            self._sequence = list(range(len(self._chunks)))
        self._starts, total = [], 0  # position at which each chunk of the sequence starts
        for chunk in self._sequence:
            self._starts.append(total)
            total += self._chunks[chunk][1] - self._chunks[chunk][0]
        self._length = total
        self._cached: tuple[int, Optional[torch.Tensor]] = (-1, None)

    def __len__(self) -> int:
        return self._length

    @property
    def chunk_starts(self) -> list[int]:
        """The position at which each chunk begins, in the epoch's chunk sequence."""
        return list(self._starts)

    def __getitem__(self, positions: slice) -> torch.Tensor:
        start, stop, step = positions.indices(self._length)
        if step != 1:
            raise ValueError("a ChunkedOrder is sliced in steps of 1")
        pieces = []
        i = max(0, bisect_right(self._starts, start) - 1)
        while start < stop:
            offset = start - self._starts[i]
            items = self._chunk_items(i)
            take = min(stop - start, len(items) - offset)
            pieces.append(items[offset : offset + take])
            start += take
            i += 1
        return concatenate(pieces)

    def _chunk_items(self, i: int) -> torch.Tensor:
        """The global item indices of the ``i``-th chunk of the sequence, in their epoch order (the last one kept)."""
        if self._cached[0] == i and self._cached[1] is not None:
            return self._cached[1]
        chunk = self._sequence[i]
        first, end = self._chunks[chunk]
        if self.shuffle and not self.sequential:
            generator = torch.Generator().manual_seed(_mix(self.seed, self.epoch, chunk))
            size = end - first
            block = self.block if 0 < self.block < size else size
            starts = (torch.randperm(-(-size // block), generator=generator) * block).tolist()
            items = torch.cat([torch.randperm(min(block, size - s), generator=generator) + s for s in starts]) + first
        else:
            items = torch.arange(first, end)
        self._cached = (i, items)
        return items

    def digest(self) -> bytes:
        """What identifies this order across ranks: the chunk table, the seed, the epoch, shuffling."""
        chunks = digest(*self._chunks)
        settings = (self.seed, self.epoch, self.shuffle, self.block, self.sequential)
        return digest("chunks", *settings, len(self._chunks), self._length, chunks)


def concatenate(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Slices of an order, one after the other (a single slice as it is, none as an empty index vector)."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _mix(*parts: int) -> int:
    """One 63-bit generator seed from several integers, the same on every rank."""
    return int.from_bytes(digest(*parts), "little") >> 1


class PositionRange:
    """Positions ``first .. end - 1`` in order, computed slice by slice: the order of a stream's epoch too
    long to hold (an endless stream's, ``ENDLESS_POSITIONS`` long)."""

    def __init__(self, first: int, end: int) -> None:
        self.first, self.end = first, end

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, positions: slice) -> torch.Tensor:
        start, stop, step = positions.indices(len(self))
        if step != 1:
            raise ValueError("a PositionRange is sliced in steps of 1")
        return torch.arange(self.first + start, self.first + max(start, stop))

    def digest(self) -> bytes:
        return digest("positions", self.first, self.end)


# An endless stream's epoch, in positions: more than any fit trains (2^53: 9 x 10^15 samples), and small
# enough that ``epoch x length + position`` stays an int64 for a thousand epochs.
ENDLESS_POSITIONS = 2**53

BaseOrder = Union[torch.Tensor, ChunkedOrder, PositionRange]


def order_digest(order: BaseOrder) -> bytes:
    """What identifies an epoch's order across ranks, without reading a lazy one item by item."""
    return tensor_digest(order) if isinstance(order, torch.Tensor) else order.digest()


class EpochOrder:
    """The positions of ``base`` still to train this epoch (``remaining``, default all), renumbered from 0;
    ``trained_before``: those a resumed epoch had trained (default: all but ``remaining``; less where
    ``limit_train_batches`` leaves the end of the order untrained)."""

    def __init__(self, base: BaseOrder, remaining: Optional[Spans] = None, trained_before: Optional[Spans] = None) -> None:
        self.base = base
        self.remaining = Spans.prefix(len(base)) if remaining is None else remaining
        self.trained_before = self.remaining.complement(len(base)) if trained_before is None else trained_before
        self._own = Subsequence(self.remaining)

    def __len__(self) -> int:
        return self._own.size

    def __getitem__(self, positions: slice) -> torch.Tensor:
        """The sample indices at own positions ``[start, stop)``."""
        start, stop, _ = positions.indices(self._own.size)
        return concatenate([self.base[a:b] for a, b in self._own.outer(start, stop)])

    def chunk_starts(self) -> list[int]:
        """Own positions at which each chunk's items still to train begin, in order (a chunked base);
        a chunk trained already begins where the next one does."""
        assert isinstance(self.base, ChunkedOrder)
        return [self._own.before(start) for start in self.base.chunk_starts]

    def covered(self, own: Spans) -> Spans:
        """The base positions trained this epoch once the own positions ``own`` are trained."""
        return self._own.to_outer(own).union(self.trained_before)

    def digest(self) -> bytes:
        return digest(order_digest(self.base), self.remaining.pairs)


def tensor_digest(order: torch.Tensor) -> bytes:
    """A map-style order (or a custom sampler's draw), hashed once per plan (a million samples: a few milliseconds)."""
    h = hashlib.blake2b(b"order", digest_size=8)
    h.update(order.to(torch.int64).contiguous().numpy().data)  # the buffer itself: no copy of the order
    return h.digest()
