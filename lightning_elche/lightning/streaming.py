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

LitData's own ``shuffle``, ``seed`` and ``item_shuffle_window`` are kept (chunks, then blocks of
items inside each chunk, then the items of each block, permuted per epoch); its ``drop_last``, which
only served equal per-rank lengths, is not needed: every item is trained once per epoch unless the
DataLoader itself drops the last partial batch.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from typing import Any, Optional

from torch.utils.data import Dataset

from lightning_elche.lightning import _lightning

SUPPORTED_FORMS = (
    "a map-style Dataset (with __getitem__ and __len__), a LitData StreamingDataset read from a local or shared "
    "directory (`StreamingDataLoader(StreamingDataset(dir), batch_size=...)` or a torch DataLoader over it), or an "
    "IterableDataset with a `shards()` method listing its shards (docs/streaming.md#sharded-iterables)"
)


def is_streaming_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a LitData StreamingDataset (litdata is only looked at once the user imported it)."""
    if "litdata" not in sys.modules:
        return False
    from litdata import StreamingDataset

    return isinstance(dataset, StreamingDataset)


def chunk_table(dataset: Any) -> tuple[tuple[int, int], ...]:
    """Each chunk's ``(first item, end item)`` global indices, refusing what ElChe cannot read by index."""
    if getattr(dataset.input_dir, "url", None) is not None:
        raise ValueError(
            f"ElCheStrategy reads a StreamingDataset item by item from local or shared storage; this one streams from "
            f"{dataset.input_dir.url}, where ranks would download the same chunks and LitData's cache could evict a "
            "chunk another rank still reads. Copy the optimized dataset to a local or shared directory (LitData's "
            "`cache_dir` or a parallel file system) and pass that path, or use strategy='ddp'."
        )
    if getattr(dataset, "window_direct_io", False):
        raise ValueError(
            "ElCheStrategy reads a StreamingDataset item by item; `window_direct_io=True` only allows LitData's "
            "read_window. Leave window_direct_io=False, or use strategy='ddp'."
        )
    intervals = _lightning.streaming_chunk_intervals(dataset)
    return tuple((int(interval.roi_start_idx), int(interval.roi_end_idx)) for interval in intervals)


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
