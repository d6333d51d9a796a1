"""Epoch orders and coverage spans: the streaming order is a chunk-local permutation computed slice
by slice, and coverage as spans means the same samples as a bit per sample would."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_elche.cohort.coverage import Spans, Subsequence
from lightning_elche.cohort.order import ChunkedOrder, EpochOrder
from lightning_elche.cohort.train_data import TrainData

span_lists = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)).map(lambda p: (p[0], p[0] + p[1])), max_size=8)


def as_set(spans: Spans) -> set[int]:
    return {p for start, end in spans for p in range(start, end)}


@given(span_lists, span_lists)
def test_spans_behave_as_sets_of_positions(a, b):
    x, y = Spans(a), Spans(b)
    assert as_set(x) == {p for s, e in a for p in range(s, e)}
    assert all(prev[1] < nxt[0] for prev, nxt in zip(x.pairs, x.pairs[1:]))  # sorted, disjoint, not touching
    assert as_set(x.union(y)) == as_set(x) | as_set(y)
    assert as_set(x.minus(y)) == as_set(x) - as_set(y)
    assert as_set(x.intersect(y)) == as_set(x) & as_set(y)
    assert as_set(x.complement(80)) == set(range(80)) - as_set(x)
    assert x.size == len(as_set(x)) and x.positions().tolist() == sorted(as_set(x))
    assert Spans.of_positions(x.positions()) == x and Spans.from_tensor(x.to_tensor()) == x


@given(span_lists, st.integers(0, 80), st.integers(0, 80))
def test_a_subsequence_maps_its_positions_to_the_outer_ones(spans, a, b):
    outer = Spans(spans)
    sub = Subsequence(outer)
    start, stop = sorted((min(a, sub.size), min(b, sub.size)))
    assert [p for s, e in sub.outer(start, stop) for p in range(s, e)] == outer.positions().tolist()[start:stop]


CHUNKS = ((0, 7), (7, 20), (20, 21), (21, 40))


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_chunked_order_is_a_permutation_that_stays_inside_each_chunk(shuffle):
    order = ChunkedOrder(CHUNKS, seed=3, epoch=1, shuffle=shuffle)
    whole = order[0:40]
    assert sorted(whole.tolist()) == list(range(40))
    chunk_of = {i: c for c, (s, e) in enumerate(CHUNKS) for i in range(s, e)}
    runs = [chunk_of[i] for i in whole.tolist()]
    assert sum(runs[k] != runs[k - 1] for k in range(1, 40)) == 3  # each chunk in one run: reads stay per chunk
    if not shuffle:
        assert whole.tolist() == list(range(40))
    else:
        assert whole.tolist() != list(range(40)) and runs != sorted(runs)  # items and chunks both permuted
    assert torch.equal(torch.cat([order[a:b] for a, b in [(0, 5), (5, 19), (19, 33), (33, 40)]]), whole)


def test_a_chunked_order_depends_on_seed_and_epoch_only():
    a, b = ChunkedOrder(CHUNKS, 3, 1, True), ChunkedOrder(CHUNKS, 3, 1, True)
    assert torch.equal(a[0:40], b[0:40]) and a.digest() == b.digest()
    for other in (ChunkedOrder(CHUNKS, 4, 1, True), ChunkedOrder(CHUNKS, 3, 2, True)):
        assert not torch.equal(a[0:40], other[0:40]) and a.digest() != other.digest()


def test_a_remaining_order_skips_what_was_trained_and_records_coverage_in_full_positions():
    base = ChunkedOrder(CHUNKS, seed=3, epoch=0, shuffle=True)
    order = EpochOrder(base, remaining=Spans([(5, 12), (30, 40)]))
    assert len(order) == 17
    assert torch.equal(order[0:17], torch.cat([base[5:12], base[30:40]]))
    assert order.covered(Spans.prefix(9)) == Spans([(0, 12), (12, 30), (30, 32)]) == Spans([(0, 32)])
    assert order.covered(Spans()) == Spans([(0, 5), (12, 30)])


@settings(max_examples=30, deadline=None)
@given(span_lists, st.booleans())
def test_a_resume_in_another_seed_trains_exactly_the_samples_left(spans, chunked):
    """Coverage spans are positions in the order of the seed the checkpoint was written with."""
    covered = Spans(spans).intersect(Spans.prefix(64))
    chunks = ((0, 10), (10, 40), (40, 64)) if chunked else None
    data = TrainData(64, seed=1, shuffle=True, batch_size=4, samples_per_step=4, drop_last=False, chunks=chunks)
    trained = set(data.samples_at(2, covered).tolist())
    for seed in (1, 9):
        resumed = TrainData(64, seed=seed, shuffle=True, batch_size=4, samples_per_step=4, drop_last=False, chunks=chunks)
        if 64 - len(trained) < 2:
            continue
        plan = resumed.plan(2, world_size=2, covered=covered, covered_seed=1)
        assert sorted(plan.order[0 : len(plan.order)].tolist()) == sorted(set(range(64)) - trained)


def test_inside_a_chunk_the_order_stays_in_one_block_at_a_time():
    """LitData decodes a chunk's rows in aligned blocks and keeps the last one: reading a block's items
    together costs one decode, so the order permutes blocks, then the items inside each block."""
    order = ChunkedOrder(((0, 10), (10, 40)), seed=3, epoch=0, shuffle=True, block=4)
    whole = order[0:40].tolist()
    assert sorted(whole) == list(range(40))
    block_of = [(i // 10, (i % 10) // 4) if i < 10 else (1, (i - 10) // 4) for i in whole]
    runs = [b for k, b in enumerate(block_of) if k == 0 or b != block_of[k - 1]]
    assert len(runs) == len(set(runs)) == 3 + 8  # each block read in one run, the short last ones too
    assert whole != sorted(whole) and block_of != sorted(block_of)  # blocks and items both permuted
    assert ChunkedOrder(((0, 10), (10, 40)), 3, 0, True, block=4).digest() != ChunkedOrder(((0, 10), (10, 40)), 3, 0, True).digest()


def test_a_sequential_chunked_order_permutes_the_chunks_and_keeps_each_chunks_items_in_order():
    order = ChunkedOrder(CHUNKS, seed=3, epoch=1, shuffle=True, sequential=True)
    whole = order[0:40].tolist()
    assert sorted(whole) == list(range(40))
    starts = order.chunk_starts
    runs = [whole[a:b] for a, b in zip(starts, [*starts[1:], 40])]
    assert sorted(runs) == [list(range(s, e)) for s, e in CHUNKS]  # every chunk whole and in order
    assert runs != sorted(runs)  # the chunks themselves permuted
    assert order.digest() != ChunkedOrder(CHUNKS, seed=3, epoch=1, shuffle=True).digest()


def test_a_remaining_order_tells_where_each_chunks_items_left_to_train_begin():
    base = ChunkedOrder(CHUNKS, seed=0, epoch=0, shuffle=False, sequential=True)
    left = EpochOrder(base, Spans([(3, 7), (25, 40)]))  # chunk 0 from its 4th item; chunks 1, 2 trained; chunk 3 partly
    assert left.chunk_starts() == [0, 4, 4, 4]
    assert left[0:6].tolist() == [3, 4, 5, 6, 25, 26]
    assert Subsequence(Spans([(3, 7), (25, 40)])).before(30) == 9
