"""Sharded iterables under ElChe: an ``IterableDataset`` that says how it is divided, read shard by shard.

An iterable dataset has no indices, so ElChe cannot hand out its items one by one. One that can
list its shards can be handed out shard by shard, which is how sharded data is read anyway
(WebDataset tar files, Hugging Face streaming shards, files of records). The protocol:

- the dataset is a ``torch.utils.data.IterableDataset`` with a method ``shards()`` that returns
  the same list of shards on every rank and at every call;
- each shard is an iterable whose ``iter()`` yields its items from the first, every time, and
  whose ``len()`` is its number of items; a shard without ``len()`` is counted once, by reading it,
  before training (the ranks share the reading).

The shards become the chunks of the epoch's order (``cohort/order.py``, read in order: items are
not shuffled inside a shard, shards are permuted per epoch unless the dataset's
``shuffle_shards`` is False), and dynamic dispatch hands out whole shards (``cohort/pool.py``):
a rank claims the next shard when it needs data, so a faster rank trains more of them. The train
DataLoader is rebuilt over :class:`ShardItems`, a map-style view that reads each shard forward from
where it stands. The dataset's own ``__iter__`` is not used (it stays what ``strategy="ddp"`` reads).
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Iterable, Iterator, Optional, Sequence

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import IterableDataset

from lightning_elche.comm.groups import split_among_ranks
from lightning_elche.lightning.streaming import ChunkedItems


def is_sharded_iterable(dataset: object) -> bool:
    """Whether ``dataset`` follows the protocol: an IterableDataset with a ``shards()`` method."""
    return isinstance(dataset, IterableDataset) and callable(getattr(dataset, "shards", None))


def shard_list(dataset: Any) -> Sequence[Iterable[Any]]:
    shards = dataset.shards()
    if not isinstance(shards, Sequence) or not shards:
        raise ValueError(
            f"ElCheStrategy reads {type(dataset).__name__}.shards() as a non-empty list of shards (each an object "
            "whose iter() reads the shard from its first item, best with len()), got "
            f"{type(shards).__name__}{' (empty)' if isinstance(shards, Sequence) else ''}"
        )
    return shards


def shard_table(dataset: Any) -> tuple[tuple[int, int], ...]:
    """Each shard's ``(first item, end item)`` in the dataset's item numbering, from the shards' lengths;
    shards without ``len()`` are counted once by reading them, the ranks sharing the work."""
    shards = shard_list(dataset)
    lengths = [_length(shard) for shard in shards]
    unknown = [number for number, length in enumerate(lengths) if length is None]
    if unknown:
        rank_zero_warn(
            f"ElChe: {len(unknown)} of {type(dataset).__name__}'s {len(shards)} shards have no len(); ElChe reads them "
            "once to count their items (the ranks share the reading) before training, at every fit. Give each "
            "shard a len() (its number of items) to skip this."
        )
        for number, length in split_among_ranks(unknown, lambda number: _count(shards[number], number)).items():
            lengths[number] = length
    table, start = [], 0
    for length in lengths:
        assert length is not None
        table.append((start, start + length))
        start += length
    return tuple(table)


def _length(shard: Any) -> Optional[int]:
    try:
        return len(shard)
    except TypeError:
        return None


def _count(shard: Iterable[Any], number: int) -> int:
    if iter(shard) is shard:
        raise ValueError(
            f"shard {number} ({type(shard).__name__}) is an iterator: ElCheStrategy reads a shard whenever a rank "
            "trains it (and counts one without len() first), so each shard's iter() must start from its first item "
            "every time. Return re-iterable shards (an object whose __iter__ opens the shard) from shards()"
        )
    return sum(1 for _ in shard)


def shard_settings(dataset: Any, seed: Optional[int]) -> dict[str, Any]:
    """The order's seed (ElChe's ``seed``, else the dataset's ``seed``, else 0) and shard shuffling."""
    return {
        "seed": int(getattr(dataset, "seed", 0) if seed is None else seed),
        "shuffle": bool(getattr(dataset, "shuffle_shards", True)),
    }


class ShardItems(ChunkedItems):
    """A sharded iterable as a map-style dataset: item ``i`` is read from its shard, which each process
    reads forward from where it stands (a shard is reopened only to go back)."""

    def __init__(self, shards: Sequence[Iterable[Any]], table: tuple[tuple[int, int], ...]) -> None:
        super().__init__(table)
        self.shards = shards
        self._reading: Optional[tuple[int, int, Iterator[Any]]] = None  # shard, next offset, its iterator

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reading": None}  # a worker process opens its own shards

    def __getitem__(self, index: int) -> Any:
        shard, offset = self.locate(index)
        reading = self._reading
        if reading is not None and reading[0] == shard and reading[1] <= offset:
            iterator, skip = reading[2], offset - reading[1]
        else:
            iterator, skip = iter(self.shards[shard]), offset
        for item in islice(iterator, skip, None):  # the items between were trained by another rank or worker
            self._reading = (shard, offset + 1, iterator)
            return item
        raise RuntimeError(
            f"shard {shard} ended before its item {offset}: its len() says {self._ends[shard] - self._starts[shard]}. "
            "ElCheStrategy needs each shard's len() to be its number of items"
        )
