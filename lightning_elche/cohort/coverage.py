"""An epoch's coverage as spans of positions in its order.

A checkpoint must say which samples of the current epoch were trained. Under planned dispatch
they are a prefix of the epoch's order (the closed windows' pieces, back to back); under dynamic
dispatch a prefix minus the few tickets some rank still holds; a resumed epoch adds the spans it
started with. So a handful of ``[start, end)`` spans describes the coverage whatever the
dataset's size, where a bit per sample grows with it (10^7 samples: 1.25 MB packed, 10 MB as a
bool tensor) and streaming datasets must not hold anything per item.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Iterator

import torch


class Spans:
    """Sorted, disjoint, non-touching half-open ``[start, end)`` ranges of positions."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted((int(s), int(e)) for s, e in pairs if e > s):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.pairs: tuple[tuple[int, int], ...] = tuple(merged)

    @classmethod
    def prefix(cls, end: int) -> "Spans":
        return cls([(0, end)])

    @classmethod
    def of_positions(cls, positions: torch.Tensor) -> "Spans":
        """The spans of a sorted vector of distinct positions (runs of consecutive ones merge)."""
        if positions.numel() == 0:
            return cls()
        breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
        ends = torch.cat([breaks, torch.tensor([positions.numel()])])
        return cls(zip(positions[starts].tolist(), (positions[ends - 1] + 1).tolist()))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "Spans":
        return cls(tuple(pair) for pair in tensor.view(-1, 2).tolist())

    def to_tensor(self) -> torch.Tensor:
        """An int64 ``[k, 2]`` tensor (what a checkpoint stores)."""
        return torch.tensor(self.pairs, dtype=torch.int64).view(-1, 2)

    @property
    def size(self) -> int:
        """How many positions the spans cover."""
        return sum(end - start for start, end in self.pairs)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pairs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spans) and self.pairs == other.pairs

    def __repr__(self) -> str:
        return f"Spans({list(self.pairs)})"

    def union(self, other: "Spans") -> "Spans":
        return Spans(self.pairs + other.pairs)

    def minus(self, other: "Spans") -> "Spans":
        return self.intersect(other.complement(max(self.end, other.end)))

    def intersect(self, other: "Spans") -> "Spans":
        out, j = [], 0
        for start, end in self.pairs:
            while j < len(other.pairs) and other.pairs[j][1] <= start:
                j += 1
            k = j
            while k < len(other.pairs) and other.pairs[k][0] < end:
                out.append((max(start, other.pairs[k][0]), min(end, other.pairs[k][1])))
                k += 1
        return Spans(out)

    def complement(self, total: int) -> "Spans":
        """The positions in ``[0, total)`` these spans leave out."""
        out, cursor = [], 0
        for start, end in self.pairs:
            out.append((cursor, min(start, total)))
            cursor = max(cursor, end)
        out.append((cursor, total))
        return Spans(out)

    @property
    def end(self) -> int:
        return self.pairs[-1][1] if self.pairs else 0

    def positions(self) -> torch.Tensor:
        """Every covered position, materialised (for small sets)."""
        if not self.pairs:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(start, end) for start, end in self.pairs])


class Subsequence:
    """The positions ``spans`` select from a longer sequence, renumbered ``0 .. size - 1``.

    A resumed epoch trains only what its checkpoint left: its own positions map back to the
    positions of the epoch's full order, in which coverage is recorded.
    """

    def __init__(self, spans: Spans) -> None:
        self.spans = spans
        self._outer_starts = [start for start, _ in spans]
        self._starts = []  # own position where each span begins
        total = 0
        for start, end in spans:
            self._starts.append(total)
            total += end - start
        self.size = total

    def outer(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The outer spans holding own positions ``[start, stop)``, in order."""
        out = []
        i = max(0, bisect_right(self._starts, start) - 1)
        while start < stop and i < len(self._starts):
            outer_start, outer_end = self.spans.pairs[i]
            offset = start - self._starts[i]
            take = min(stop - start, outer_end - outer_start - offset)
            if take > 0:
                out.append((outer_start + offset, outer_start + offset + take))
                start += take
            i += 1
        return out

    def before(self, outer: int) -> int:
        """How many own positions lie before the outer position ``outer``."""
        i = bisect_right(self._outer_starts, outer) - 1
        if i < 0:
            return 0
        start, end = self.spans.pairs[i]
        return self._starts[i] + min(outer, end) - start

    def to_outer(self, own: Spans) -> Spans:
        return Spans(pair for start, end in own for pair in self.outer(start, end))
