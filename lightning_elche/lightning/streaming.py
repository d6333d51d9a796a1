"""Streaming datasets under ElChe: LitData's ``StreamingDataset``, read item by item through its chunks.

LitData shards a ``StreamingDataset`` itself: at construction it reads the world size and rank
and gives each rank an equal, fixed part of the chunks (dropping a tail so the parts match),
which is what makes uneven ranks wait or hang. ElChe hands out the data by speed instead, so it
reads the dataset the way LitData's own ``dataset[ChunkedIndex]`` does and never iterates it:

- the chunk table (each chunk's first and last item) describes the data to the plan, which
  orders the items chunk by chunk (``cohort/order.py``) and hands them out with the same planned
  or dynamic dispatch as a map-style dataset: a rank holds a few ints per chunk, never the items
  or their order;
- the train DataLoader is rebuilt as a plain torch DataLoader over :class:`StreamingItems`, a
  map-style view that reads one item by its global index, with the user's batch size, collate
  function, workers, prefetching and pinning, and ElChe's sampler (``data.py``).

A remote dataset (``s3://``...) downloads each chunk into LitData's cache when a rank first reads it;
under dynamic dispatch its chunks are claimed whole (:func:`is_remote`), so a chunk is downloaded and
evicted by the one rank that trains it.

LitData's own ``shuffle``, ``seed`` and ``item_shuffle_window`` are kept (chunks, then blocks of
items inside each chunk, then the items of each block, permuted per epoch); its ``drop_last``, which
only served equal per-rank lengths, is not needed: every item is trained once per epoch unless the
DataLoader itself drops the last partial batch.

A ``CombinedStreamingDataset`` of them is read the same way, its datasets' items numbered one after
the other (:class:`CombinedItems`); its epoch's order (:class:`CombinedDraws`) is each dataset's own
order, interleaved at random as LitData mixes them: item by item (``batching_method="stratified"``)
or batch by batch (``"per_stream"``), every item once (``iterate_over_all``) or with ``weights`` until
a dataset runs out. The draw is a function of the seed and the epoch, like a custom sampler's
(``data.SamplerDraws``), and lives beside it in the adapter for the same reason: it reads the user's
dataset's settings.

A ``ParallelStreamingDataset`` zips its datasets: sample ``s`` of its stream is item ``s`` of each
dataset's own order (cycled where ``length`` asks for more than a dataset holds), passed through its
``transform``. Its epoch's order is the epoch's stream positions (:class:`ParallelPositions`), handed
out by speed like any order; :class:`ParallelItems` reads the sample at a position. The positions
carry their epoch (``epoch x length + i``), so a DataLoader worker knows which cycle of each dataset to
read without being told the epoch.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
from bisect import bisect_right
from typing import Any, Optional, Sequence

import torch
from torch.utils.data import Dataset

from lightning_elche.cohort.order import ENDLESS_POSITIONS, BaseOrder, ChunkedOrder, PositionRange
from lightning_elche.lightning import _lightning

SUPPORTED_FORMS = (
    "a map-style Dataset (with __getitem__ and __len__), a LitData StreamingDataset from a local, shared or remote "
    "directory (`StreamingDataLoader(StreamingDataset(dir), batch_size=...)` or a torch DataLoader over it), a "
    "CombinedStreamingDataset or ParallelStreamingDataset of them, or an "
    "IterableDataset with a `shards()` method listing its shards (docs/streaming.md#sharded-iterables)"
)


def is_streaming_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a LitData StreamingDataset (litdata is only looked at once the user imported it)."""
    if "litdata" not in sys.modules:
        return False
    from litdata import StreamingDataset

    return isinstance(dataset, StreamingDataset)


def is_combined_streaming_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a LitData CombinedStreamingDataset."""
    if "litdata" not in sys.modules:
        return False
    from litdata import CombinedStreamingDataset

    return isinstance(dataset, CombinedStreamingDataset)


def is_parallel_streaming_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a LitData ParallelStreamingDataset."""
    if "litdata" not in sys.modules:
        return False
    from litdata.streaming.parallel import ParallelStreamingDataset

    return isinstance(dataset, ParallelStreamingDataset)


def chunk_table(dataset: Any) -> tuple[tuple[int, int], ...]:
    """Each chunk's ``(first item, end item)`` global indices, refusing what ElChe cannot read by index."""
    if getattr(dataset, "window_direct_io", False):
        raise ValueError(
            "ElCheStrategy reads a StreamingDataset item by item; `window_direct_io=True` only allows LitData's "
            "read_window. Leave window_direct_io=False, or use strategy='ddp'."
        )
    intervals = _lightning.streaming_chunk_intervals(dataset)
    return tuple((int(interval.roi_start_idx), int(interval.roi_end_idx)) for interval in intervals)


def is_remote(dataset: Any) -> bool:
    """Whether a StreamingDataset downloads its chunks (``s3://``, ``gs://``, ``local:``...) into a local cache:
    then each chunk is handed out whole (``TrainData.remote_chunks``), so that one rank downloads it."""
    return getattr(dataset.input_dir, "url", None) is not None


def shared_remote_chunks(dataset: Any, dynamic: bool) -> Optional[str]:
    """Why ranks would read, and so each download, chunks of remote storage that other ranks read too (a
    warning), or None where every remote chunk is claimed whole by one rank (dynamic dispatch of a
    StreamingDataset) or nothing is remote. Correct either way (each rank reads through LitData's cache);
    only the downloads and cache space grow."""
    if is_streaming_dataset(dataset):
        if dynamic or not is_remote(dataset):
            return None
        return (
            f"its chunks ({dataset.input_dir.url}) are remote and this fit dispatches by plan (fixed partition_ratios, "
            "dispatch='planned', or validation/checkpoints every N steps): a window's pieces cut chunks between ranks, "
            "so a chunk may be downloaded by every rank that trains part of it. Dynamic dispatch claims each remote "
            "chunk whole"
        )
    if is_combined_streaming_dataset(dataset):
        parts = _lightning.combined_streaming_parts(dataset)[0]
    elif is_parallel_streaming_dataset(dataset):
        parts = _lightning.parallel_streaming_parts(dataset).datasets
    else:
        return None
    remote = [part.input_dir.url for part in parts if is_streaming_dataset(part) and is_remote(part)]
    if not remote:
        return None
    return (
        f"the {type(dataset).__name__} reads remote chunks ({', '.join(remote)}) item by item, interleaved across "
        "its datasets, so ranks share chunks and each downloads the chunks it reads"
    )


class ChunkedItems(Dataset):
    """A dataset stored in chunks, seen as a map-style dataset over its global item numbering."""

    def __init__(self, chunks: tuple[tuple[int, int], ...]) -> None:
        self._starts = [start for start, _ in chunks]
        self._ends = [end for _, end in chunks]
        self._length = sum(end - start for start, end in chunks)

    def __len__(self) -> int:
        return self._length

    def locate(self, index: int) -> tuple[int, int]:
        """The chunk holding item ``index`` and the item's offset in it."""
        chunk = bisect_right(self._starts, index) - 1
        if chunk < 0 or index >= self._ends[chunk]:
            raise IndexError(f"item {index} is in no chunk of the {type(self).__name__}")
        return chunk, index - self._starts[chunk]


class StreamingItems(ChunkedItems):
    """A StreamingDataset as a map-style dataset: item ``i`` is read by its chunk and global index."""

    def __init__(self, dataset: Any, chunks: tuple[tuple[int, int], ...]) -> None:
        super().__init__(chunks)
        self.dataset = dataset

    def __getitem__(self, index: int) -> Any:
        from litdata.streaming.sampler import ChunkedIndex

        chunk, _ = self.locate(index)
        return self.dataset[ChunkedIndex(index=index, chunk_index=chunk)]


def shuffle_block(dataset: Any) -> int:
    """The dataset's in-chunk shuffle block (``item_shuffle_window``, LitData's default 256; 0: whole chunks).

    LitData decodes rows in aligned windows and keeps the last one; staying inside its shuffle
    blocks keeps ElChe's reads as local as LitData's own (``cohort/order.py``).
    """
    from litdata.streaming.shuffle import resolve_item_shuffle_window

    return resolve_item_shuffle_window(getattr(dataset, "item_shuffle_window", None))


def streaming_seed(dataset: Any, seed: Optional[int]) -> int:
    """The order's seed: ElChe's ``seed`` when set, else the StreamingDataset's own."""
    return int(dataset.seed) if seed is None else seed


class CombinedItems(Dataset):
    """A CombinedStreamingDataset as one map-style dataset: dataset ``d``'s item ``i`` is item
    ``offsets[d] + i``, read from that dataset by its chunk (:class:`StreamingItems`)."""

    def __init__(self, datasets: Sequence[Any], tables: Sequence[tuple[tuple[int, int], ...]]) -> None:
        self._parts = [StreamingItems(dataset, table) for dataset, table in zip(datasets, tables)]
        self.offsets = combined_offsets(tables)

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts)

    def __getitem__(self, index: int) -> Any:
        part = bisect_right(self.offsets, index) - 1
        return self._parts[part][index - self.offsets[part]]


def combined_offsets(tables: Sequence[tuple[tuple[int, int], ...]]) -> list[int]:
    """Where each dataset's items begin in the combined numbering (after the previous one's last chunk)."""
    offsets, end = [], 0
    for table in tables:
        offsets.append(end)
        end += max((last for _, last in table), default=0)
    return offsets


class CombinedDraws:
    """The epoch order of a CombinedStreamingDataset, drawn over the whole dataset as LitData draws it on
    each rank's part: each dataset's items in the order ElChe gives a StreamingDataset (its chunks,
    blocks and shuffling, seeded with the combined seed and the dataset's place), taken a piece at a time,
    the dataset of each piece drawn at random with ``(seed, epoch)``. A piece is an item
    (``batching_method="stratified"``: a batch mixes the datasets) or a batch (``"per_stream"``: a batch
    is one dataset's).

    - ``weights`` None (``iterate_over_all=True``): every item of every dataset once per epoch, the
      pieces interleaved uniformly at random, so each dataset's share of any stretch of the epoch follows
      its size; a dataset's last, partial batch comes after every whole one (only the epoch's last few
      batches can mix under ``per_stream``).
    - ``weights`` (``iterate_over_all=False``): each piece's dataset drawn with those weights, and the
      epoch ends where a dataset with nothing left is drawn, as LitData's iterator stops; the epoch's
      length then varies from epoch to epoch, like DDP's.

    The last draw is kept: the plan reads an epoch's order several times.
    """

    def __init__(
        self, tables: Sequence[tuple[tuple[int, int], ...]], shuffles: Sequence[bool], blocks: Sequence[int],
        batch_size: Optional[int], weights: Optional[Sequence[float]] = None,
    ) -> None:
        """``batch_size``: pieces of whole batches of it (``per_stream``); None: single items."""
        self.tables, self.shuffles, self.blocks = tuple(tables), tuple(shuffles), tuple(blocks)
        self.batch_size, self.weights = batch_size, None if weights is None else tuple(weights)
        self.offsets = combined_offsets(tables)
        self._last_draw = functools.lru_cache(maxsize=1)(self._draw)

    def __call__(self, epoch: int, seed: int) -> torch.Tensor:
        return self._last_draw(epoch, seed)

    def _draw(self, epoch: int, seed: int) -> torch.Tensor:
        orders = [
            ChunkedOrder(table, seed + place, epoch, shuffle, block)[:] + offset
            for place, (table, shuffle, block, offset) in enumerate(zip(self.tables, self.shuffles, self.blocks, self.offsets))
        ]
        every = self.batch_size or 1
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        labels = self._all_items(orders, every, generator) if self.weights is None else self._until_one_runs_out(
            orders, every, generator
        )  # fmt: skip
        merged = torch.empty(len(labels), dtype=torch.long)
        for place, order in enumerate(orders):  # each dataset's items fill its labels' positions in its own order
            mine = labels == place
            merged[mine] = order[: int(mine.sum())]
        return merged

    @staticmethod
    def _all_items(orders: list[torch.Tensor], every: int, generator: torch.Generator) -> torch.Tensor:
        """Each item's dataset: whole pieces interleaved at random, then each dataset's rest."""
        places = torch.arange(len(orders))
        wholes = torch.tensor([len(order) // every for order in orders], dtype=torch.long)
        rests = torch.tensor([len(order) % every for order in orders], dtype=torch.long)
        pieces = places.repeat_interleave(wholes)
        pieces = pieces[torch.randperm(len(pieces), generator=generator)]
        return torch.cat([pieces.repeat_interleave(every), places.repeat_interleave(rests)])

    def _until_one_runs_out(self, orders: list[torch.Tensor], every: int, generator: torch.Generator) -> torch.Tensor:
        """Each item's dataset: pieces drawn with the weights until a dataset with nothing left is drawn (a
        dataset's last piece may be partial)."""
        assert self.weights is not None
        pieces_left = [-(-len(order) // every) for order in orders]
        weights = torch.tensor(self.weights, dtype=torch.double)
        drawn = torch.multinomial(weights, sum(pieces_left) + 1, replacement=True, generator=generator)
        counts = torch.stack([torch.cumsum(drawn == place, 0) for place in range(len(orders))])
        over = [torch.nonzero(counts[place] > left) for place, left in enumerate(pieces_left)]
        end = min(int(found[0]) for found in over if len(found))  # the first draw of a dataset with nothing left
        piece_sizes = torch.empty(end, dtype=torch.long)
        for place, order in enumerate(orders):
            mine = drawn[:end] == place
            taken = torch.arange(int(mine.sum()))
            piece_sizes[mine] = torch.clamp(len(order) - taken * every, max=every)
        return drawn[:end].repeat_interleave(piece_sizes)


class ParallelPositions:
    """The epoch order of a ParallelStreamingDataset: the epoch's ``length`` stream positions in order,
    numbered ``epoch x length + i`` (see :class:`ParallelItems`). LitData's own order is each
    dataset's, zipped; ElChe keeps it and splits its positions by speed."""

    def __init__(self, length: int, tables: Sequence[tuple[tuple[int, int], ...]]) -> None:
        """``tables``: each dataset's chunk table, for :class:`ParallelItems`."""
        self.length, self.tables = length, tuple(tables)

    def __call__(self, epoch: int, seed: int) -> BaseOrder:
        if self.length == ENDLESS_POSITIONS:  # an endless stream's epoch: too long to hold, read slice by slice
            return PositionRange(epoch * self.length, (epoch + 1) * self.length)
        return torch.arange(epoch * self.length, (epoch + 1) * self.length)


class ParallelItems(Dataset):
    """A ParallelStreamingDataset as a map-style dataset over :class:`ParallelPositions`: the sample at
    position ``epoch x length + i`` is, from each dataset, the item at its stream position in that
    dataset's order (ElChe's order of a StreamingDataset, seeded with the parallel seed and the
    dataset's place), then the ``transform``.

    Which stream position, as LitData's iterator has it: with ``length=None`` the epoch is the shortest
    dataset, position ``i`` of the epoch's orders; with an int ``length`` the datasets cycle, each cycle
    a new order, and ``resume=True`` (LitData's default) carries the stream on across epochs (position
    ``epoch x length + i``), ``resume=False`` starts it again every epoch (position ``i``).

    A transform that takes random generators gets ``random``, ``numpy`` and ``torch`` ones seeded with
    the parallel seed and the sample's stream position (with ``reset_rngs``: its position in the epoch):
    the same sample gets the same draw on whichever rank trains it and after a resume, where LitData
    seeds them per DataLoader worker and rank.
    """

    def __init__(self, parts: _lightning.ParallelStreamingParts, positions: ParallelPositions, seed: int) -> None:
        self._parts = [StreamingItems(part, table) for part, table in zip(parts.datasets, positions.tables)]
        self._settings, self._tables, self.length, self.seed = parts, positions.tables, positions.length, seed
        self._orders: dict[int, ChunkedOrder] = {}  # each dataset's order of the cycle read last

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, position: int) -> Any:
        settings = self._settings
        epoch, i = divmod(int(position), self.length)
        stream = int(position) if settings.resume else i
        samples = tuple(self._item(place, epoch, i, stream) for place in range(len(self._parts)))
        if settings.transform is None:
            return samples
        if not settings.transform_takes_generators:
            return settings.transform(samples)
        return settings.transform(samples, self._generators(i if settings.reset_rngs else int(position)))

    def _item(self, place: int, epoch: int, i: int, stream: int) -> Any:
        cycle, offset = (epoch, i) if self._settings.length is None else divmod(stream, len(self._parts[place]))
        order = self._orders.get(place)
        if order is None or order.epoch != cycle:  # a rank reads its positions forward: one cycle at a time
            dataset = self._settings.datasets[place]
            order = ChunkedOrder(self._tables[place], self.seed + place, cycle, bool(dataset.shuffle), shuffle_block(dataset))
            self._orders[place] = order
        return self._parts[place][int(order[offset : offset + 1][0])]

    def _generators(self, key: int) -> dict[str, Any]:
        import numpy as np

        seed = int(hashlib.sha256(str((self.seed, key)).encode()).hexdigest(), 16) % (2**32 - 1)
        return {"random": random.Random(seed), "numpy": np.random.default_rng(seed), "torch": torch.Generator().manual_seed(seed)}
