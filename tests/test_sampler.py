"""Unit tests for the training-data partition (lightning_elche/sampler.py).

Coverage is ElChe's data contract (DESIGN.md section 7): across ranks every sample of an epoch is
trained exactly once, while the per-rank shares change at every boundary. These tests drive the
plan directly, with step counts that change from window to window, and no processes.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_elche.cohort.order import epoch_order
from lightning_elche.cohort.plan import EpochPlan, prefetch_depth
from lightning_elche.lightning.data import ElCheSampler

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def cycling(step_lists: Sequence[Sequence[int]]):
    """A plan_steps callback that returns the given per-rank counts in turn, forever."""
    it: Iterator[Sequence[int]] = itertools.cycle(step_lists)
    return lambda: list(next(it))


def freeze_all(plan: EpochPlan, step_lists: Sequence[Sequence[int]]) -> int:
    """Freeze windows (counts cycling through ``step_lists``) until the plan is complete."""
    steps = cycling(step_lists)
    frozen = 0
    while not plan.complete:
        plan.freeze(steps())
        frozen += 1
        assert frozen <= len(plan.order) + 1, "the plan does not terminate"
    return frozen


def pieces(plan: EpochPlan, rank: int) -> list[int]:
    return [i for w in range(len(plan.sizes)) for i in plan.indices(w, rank).tolist()]


@st.composite
def plan_setups(draw, max_world: int = 8):
    """World size, batch size, accumulation, drop_last, dataset size and changing step counts."""
    world = draw(st.integers(1, max_world))
    batch_size = draw(st.integers(1, 8))
    accumulate = draw(st.integers(1, 3))
    drop_last = draw(st.booleans())
    minimum = world * (batch_size if drop_last else 1)
    num_samples = draw(st.integers(minimum, minimum + 600))
    windows = draw(
        st.lists(st.lists(st.integers(1, 12), min_size=world, max_size=world), min_size=1, max_size=6)
    )
    return world, batch_size, accumulate, drop_last, num_samples, windows


def make_plan(world, batch_size, accumulate, drop_last, num_samples, epoch=0, seed=0, shuffle=True) -> EpochPlan:
    order = epoch_order(num_samples, seed, epoch, shuffle)
    return EpochPlan(epoch, order, world, batch_size, batch_size * accumulate, drop_last=drop_last)


# --------------------------------------------------------------------------- epoch_order


def test_epoch_order_is_a_seeded_permutation():
    """Every rank derives the same order from (seed, epoch) with no communication."""
    a = epoch_order(1000, seed=42, epoch=3, shuffle=True)
    b = epoch_order(1000, seed=42, epoch=3, shuffle=True)
    assert torch.equal(a, b)
    assert torch.equal(torch.sort(a).values, torch.arange(1000))
    assert not torch.equal(a, torch.arange(1000))


def test_epoch_order_changes_with_epoch_and_seed():
    """Each epoch is reshuffled; a different seed gives a different order."""
    orders = [epoch_order(1000, seed=7, epoch=e, shuffle=True) for e in range(4)]
    for x, y in itertools.combinations(orders, 2):
        assert not torch.equal(x, y)
    assert not torch.equal(orders[0], epoch_order(1000, seed=8, epoch=0, shuffle=True))


def test_epoch_order_without_shuffle_is_arange():
    """shuffle=False trains in dataset order, as DistributedSampler(shuffle=False) would."""
    assert torch.equal(epoch_order(17, seed=5, epoch=9, shuffle=False), torch.arange(17))


@PROPERTY
@given(n=st.integers(0, 2000), seed=st.integers(0, 2**31), epoch=st.integers(0, 1000))
def test_epoch_order_property(n, seed, epoch):
    """Any size, seed, epoch: a permutation of range(n), reproducible."""
    order = epoch_order(n, seed, epoch, True)
    assert sorted(order.tolist()) == list(range(n))
    assert torch.equal(order, epoch_order(n, seed, epoch, True))


# --------------------------------------------------------------------------- EpochPlan basics


def test_non_final_windows_are_exact_step_multiples():
    """A window of n steps is exactly n optimizer steps' worth of samples, contiguous per rank."""
    plan = make_plan(world=2, batch_size=4, accumulate=2, drop_last=False, num_samples=1000)
    plan.freeze([3, 5])
    plan.freeze([1, 2])
    assert plan.sizes == [[24, 40], [8, 16]]
    assert plan.starts == [[0, 24], [64, 72]]
    assert plan.cursor == 88
    assert plan.remaining == 912
    assert plan.batches(0, 0) == 6 and plan.batches(0, 1) == 10
    assert torch.equal(plan.indices(1, 1), plan.order[72:88])
    assert not plan.complete
    assert [plan.steps(0, r) for r in range(2)] == [3, 5]
    assert plan.steps_from(0) == 11 and plan.steps_from(1) == 3 and plan.steps_from(2) == 0


def test_steps_of_a_final_partial_window_round_up():
    """A final piece shorter than a whole accumulation still makes one (last) optimizer step."""
    plan = make_plan(world=2, batch_size=4, accumulate=2, drop_last=False, num_samples=20)
    plan.freeze([1, 1])  # 16 would leave 4 < 2 * 8: final, 20 samples split
    assert plan.complete and sum(plan.sizes[0]) == 20
    assert [plan.steps(0, r) for r in range(2)] == [-(-size // 8) for size in plan.sizes[0]]


def test_final_window_takes_the_remainder():
    """When too little would be left for another full window, the last window takes everything."""
    plan = make_plan(world=2, batch_size=4, accumulate=1, drop_last=False, num_samples=50)
    plan.freeze([4, 4])  # 32, leaving 18 >= 2 * 4: not final
    assert not plan.complete
    plan.freeze([1, 3])  # 16 would leave 2 < 8: final, 18 split 1:3 with >= 1 each
    assert plan.complete
    assert sum(plan.sizes[-1]) == 18
    assert plan.cursor == 50
    # 4 whole batches split 1:3, the 2-sample tail to the rank with more batches
    assert plan.sizes[-1] == [4, 14]
    assert [plan.batches(1, r) for r in range(2)] == [1, 4]


def test_final_window_when_request_exceeds_remaining():
    """A request larger than what is left is shrunk proportionally; every rank still gets data."""
    plan = make_plan(world=3, batch_size=2, accumulate=1, drop_last=False, num_samples=7)
    plan.freeze([10, 10, 100])
    assert plan.complete
    assert sum(plan.sizes[0]) == 7
    assert min(plan.sizes[0]) >= 1


def test_final_window_drop_last_gives_whole_batches():
    """With drop_last the last window hands out whole batches only; the tail is < batch_size."""
    plan = make_plan(world=3, batch_size=4, accumulate=1, drop_last=True, num_samples=12 + 11)
    plan.freeze([5, 1, 1])
    assert plan.complete
    assert all(s % 4 == 0 and s >= 4 for s in plan.sizes[0])
    assert sum(plan.sizes[0]) == 20  # 23 // 4 = 5 batches; 3 samples dropped
    assert len(plan.order) - plan.cursor == 3


def test_freeze_rejects_bad_counts():
    """One count >= 1 per rank is required; anything else is a wiring bug."""
    plan = make_plan(world=3, batch_size=2, accumulate=1, drop_last=False, num_samples=100)
    with pytest.raises(ValueError, match="one step count >= 1 per rank"):
        plan.freeze([1, 1])
    with pytest.raises(ValueError, match="one step count >= 1 per rank"):
        plan.freeze([1, 0, 1])
    assert plan.sizes == [] and plan.cursor == 0


def test_freezing_after_complete_raises():
    """No window may follow the final one: that would be a second pass over the epoch."""
    plan = make_plan(world=2, batch_size=2, accumulate=1, drop_last=False, num_samples=10)
    freeze_all(plan, [[1, 1]])
    with pytest.raises(RuntimeError, match="complete"):
        plan.freeze([1, 1])


@pytest.mark.parametrize(
    "num_samples, world, batch_size, drop_last",
    [(3, 4, 1, False), (0, 1, 1, False), (7, 2, 4, True), (15, 4, 4, True)],
)
def test_too_small_dataset_raises(num_samples, world, batch_size, drop_last):
    """A dataset that cannot give every rank a batch is refused with an actionable message."""
    order = torch.arange(num_samples)
    with pytest.raises(ValueError, match=r"too few to give each of \d+ ranks a batch") as info:
        EpochPlan(0, order, world, batch_size, batch_size, drop_last=drop_last)
    assert f"has {num_samples} samples" in str(info.value)
    assert "larger dataset or fewer devices" in str(info.value)


def test_smallest_allowed_dataset_works():
    """Exactly one sample (or one batch with drop_last) per rank is enough."""
    plan = make_plan(world=4, batch_size=3, accumulate=1, drop_last=False, num_samples=4)
    plan.freeze([5, 1, 1, 1])
    assert plan.complete and plan.sizes == [[1, 1, 1, 1]]
    plan = make_plan(world=2, batch_size=3, accumulate=1, drop_last=True, num_samples=6)
    plan.freeze([1, 1])
    assert plan.complete and plan.sizes == [[3, 3]]


# --------------------------------------------------------------------------- EpochPlan properties


@PROPERTY
@given(setup=plan_setups())
def test_plan_pieces_disjoint_and_cover_epoch(setup):
    """Shares changing at every window, the frozen pieces still tile the epoch's order exactly.

    Without drop_last every index is used once. With drop_last the pieces cover a prefix of the
    order and the dropped tail is ``remaining % batch_size`` before the last window: strictly
    fewer than batch_size samples (the whole cohort drops less than one batch, whereas DDP's
    DistributedSampler + DataLoader(drop_last) drops up to a batch per rank).
    """
    world, batch_size, accumulate, drop_last, num_samples, windows = setup
    sps = batch_size * accumulate
    plan = make_plan(world, batch_size, accumulate, drop_last, num_samples)
    steps = cycling(windows)
    requested = []
    while not plan.complete:
        request = steps()
        requested.append(request)
        remaining_before = plan.remaining
        plan.freeze(request)
    assert len(plan.sizes) == len(plan.starts) == len(requested)

    # Contiguous, in window then rank order: starts follow each other with no gap or overlap.
    cursor = 0
    for starts, sizes in zip(plan.starts, plan.sizes):
        for start, size in zip(starts, sizes):
            assert start == cursor
            cursor += size
    assert cursor == plan.cursor

    used = [i for w in range(len(plan.sizes)) for r in range(world) for i in plan.indices(w, r).tolist()]
    assert len(used) == len(set(used))  # disjoint
    order = plan.order[:].tolist()
    if drop_last:
        dropped = num_samples - len(used)
        assert used == order[: len(used)]
        assert dropped == remaining_before % batch_size < batch_size
    else:
        assert sorted(used) == sorted(order) == list(range(num_samples))

    # Non-final windows: exactly steps * samples_per_step per rank.
    for request, sizes in zip(requested[:-1], plan.sizes[:-1]):
        assert sizes == [s * sps for s in request]
    # Final window: every rank gets data; whole batches (>= 1) with drop_last.
    final = plan.sizes[-1]
    assert all(s >= 1 for s in final)
    if drop_last:
        assert all(s % batch_size == 0 and s >= batch_size for s in final)
    for w in range(len(plan.sizes)):
        for r in range(world):
            assert plan.batches(w, r) == math.ceil(plan.sizes[w][r] / batch_size)
    if drop_last:  # then every piece of every window is whole batches
        assert all(s % batch_size == 0 for sizes in plan.sizes for s in sizes)


@PROPERTY
@given(setup=plan_setups(), lookahead=st.integers(1, 8))
def test_freeze_ahead_keeps_lookahead(setup, lookahead):
    """Every boundary leaves each rank >= lookahead batches decided past the window in training.

    This is what keeps the DataLoader's prefetch from ever asking for an undecided window.
    """
    world, batch_size, accumulate, drop_last, num_samples, windows = setup
    plan = make_plan(world, batch_size, accumulate, drop_last, num_samples)
    steps = cycling(windows)
    window = 0
    while True:
        plan.freeze_ahead(window, lookahead, steps)
        assert len(plan.sizes) > window
        if not plan.complete:
            for r in range(world):
                assert plan.frozen_batches_after(window, r) >= lookahead
        if window == len(plan.sizes) - 1 and plan.complete:
            break
        window += 1  # the boundary closing `window`
    for r in range(world):
        assert plan.frozen_batches_after(window, r) == 0


def test_freeze_ahead_freezes_only_what_is_needed():
    """freeze_ahead does not run the plan ahead further than the lookahead requires."""
    plan = make_plan(world=2, batch_size=1, accumulate=1, drop_last=False, num_samples=10_000)
    plan.freeze_ahead(0, 3, cycling([[2, 4]]))
    # window 0 (being trained) + window 1 gives rank 0 only 2 batches ahead; window 2 makes it 4.
    assert len(plan.sizes) == 3
    plan.freeze_ahead(1, 3, cycling([[2, 4]]))
    assert len(plan.sizes) == 4
    plan.freeze_ahead(1, 3, cycling([[2, 4]]))  # already enough: idempotent
    assert len(plan.sizes) == 4


def test_frozen_batches_after_counts_later_windows_only():
    """The lookahead counts batches in windows after `window`, per rank."""
    plan = make_plan(world=2, batch_size=2, accumulate=1, drop_last=False, num_samples=1000)
    plan.freeze([1, 2])
    plan.freeze([3, 4])
    plan.freeze([5, 6])
    assert plan.frozen_batches_after(0, 0) == 8
    assert plan.frozen_batches_after(0, 1) == 10
    assert plan.frozen_batches_after(1, 1) == 6
    assert plan.frozen_batches_after(2, 0) == 0


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_identical_for_identical_plans():
    """Ranks that froze the same windows report the same number (no false plan mismatch)."""
    a = make_plan(world=3, batch_size=2, accumulate=1, drop_last=False, num_samples=500, epoch=2)
    b = make_plan(world=3, batch_size=2, accumulate=1, drop_last=False, num_samples=500, epoch=2)
    for steps in ([1, 2, 3], [4, 4, 1], [2, 2, 2]):
        a.freeze(steps)
        b.freeze(steps)
        assert a.fingerprint() == b.fingerprint()
    assert 0 <= a.fingerprint() < 2**24  # exact in float32, the control payload's dtype


def test_fingerprint_differs_when_plans_differ():
    """Any difference a boundary could see (epoch, window count, recent sizes) changes the number."""

    def fp(epoch=0, windows=([1, 2], [3, 4])):
        plan = make_plan(world=2, batch_size=2, accumulate=1, drop_last=False, num_samples=1000, epoch=epoch)
        for steps in windows:
            plan.freeze(list(steps))
        return plan.fingerprint()

    base = fp()
    assert fp(epoch=1) != base
    assert fp(windows=([1, 2],)) != base  # one window fewer
    assert fp(windows=([1, 2], [3, 4], [1, 1])) != base  # one window more
    assert fp(windows=([1, 2], [3, 5])) != base  # different size, different cursor
    assert fp(windows=([1, 2], [4, 3])) != base  # same cursor, sizes swapped between ranks
    assert fp(windows=([2, 1], [3, 4])) != base  # same cursor, earlier window swapped


@PROPERTY
@given(
    world=st.integers(1, 8),
    windows=st.lists(st.lists(st.integers(1, 20), min_size=8, max_size=8), min_size=1, max_size=4),
    change_window=st.integers(0, 3),
    change_rank=st.integers(0, 7),
    delta=st.integers(1, 5),
)
def test_fingerprint_detects_one_changed_count(world, windows, change_window, change_rank, delta):
    """Two plans whose last <= 4 windows differ in one rank's count get different fingerprints."""
    change_window %= len(windows)
    change_rank %= world
    other = [list(w[:world]) for w in windows]
    other[change_window][change_rank] += delta
    a = make_plan(world=world, batch_size=1, accumulate=1, drop_last=False, num_samples=10_000)
    b = make_plan(world=world, batch_size=1, accumulate=1, drop_last=False, num_samples=10_000)
    for wa, wb in zip(windows, other):
        a.freeze(list(wa[:world]))
        b.freeze(wb)
    assert a.fingerprint() != b.fingerprint()


# --------------------------------------------------------------------------- ElCheSampler


def test_sampler_yields_its_rank_pieces_in_order():
    """Iterating yields this rank's pieces, window after window, and nothing else."""
    plan = make_plan(world=3, batch_size=2, accumulate=1, drop_last=False, num_samples=100, epoch=4)
    freeze_all(plan, [[1, 2, 3], [5, 1, 1]])
    epochs = []

    def begin_epoch(epoch):
        epochs.append(epoch)
        return plan

    for rank in range(3):
        sampler = ElCheSampler(begin_epoch, rank=rank)
        sampler.set_epoch(4)
        expected = torch.cat([plan.indices(w, rank) for w in range(len(plan.sizes))]).tolist()
        assert list(sampler) == expected
    assert epochs == [4, 4, 4]


def test_sampler_has_no_len():
    """No __len__: Lightning must end the epoch at exhaustion and cache no per-rank length."""
    sampler = ElCheSampler(lambda e: None, rank=0)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        len(sampler)


def test_sampler_sees_windows_frozen_while_it_iterates():
    """Windows frozen at a boundary after iteration began are read live, not from a snapshot."""
    plan = make_plan(world=2, batch_size=1, accumulate=1, drop_last=False, num_samples=40)
    plan.freeze([2, 3])
    it = iter(ElCheSampler(lambda e: plan, rank=1))
    first = [next(it) for _ in range(3)]
    assert first == plan.indices(0, 1).tolist()
    freeze_all(plan, [[4, 1]])
    rest = list(it)
    assert first + rest == pieces(plan, 1)


def test_sampler_raises_past_unfrozen_windows():
    """Running past the decided windows is an explicit error, never a silent short epoch or hang."""
    plan = make_plan(world=2, batch_size=1, accumulate=1, drop_last=False, num_samples=100)
    plan.freeze([2, 3])
    it = iter(ElCheSampler(lambda e: plan, rank=0))
    assert [next(it), next(it)] == plan.indices(0, 0).tolist()
    with pytest.raises(RuntimeError, match="rank 0 reached window 1 of epoch 0 before it was planned"):
        next(it)


def test_sampler_on_empty_plan_raises():
    """A plan nobody froze a window of cannot be iterated."""
    plan = make_plan(world=2, batch_size=1, accumulate=1, drop_last=False, num_samples=100)
    with pytest.raises(RuntimeError, match="before it was planned"):
        list(ElCheSampler(lambda e: plan, rank=1))


@PROPERTY
@given(setup=plan_setups(), seed=st.integers(0, 1000), epoch=st.integers(0, 50), shuffle=st.booleans())
def test_samplers_together_cover_the_epoch_once(setup, seed, epoch, shuffle):
    """Union over ranks of what the samplers yield (plan fully frozen) is every index once."""
    world, batch_size, accumulate, drop_last, num_samples, windows = setup
    plan = make_plan(world, batch_size, accumulate, drop_last, num_samples, epoch=epoch, seed=seed, shuffle=shuffle)
    freeze_all(plan, windows)
    yielded = []
    for rank in range(world):
        sampler = ElCheSampler(lambda e: plan, rank=rank, epoch=epoch)
        got = list(sampler)
        assert got == pieces(plan, rank)
        yielded.extend(got)
    assert len(yielded) == len(set(yielded))
    if drop_last:
        assert num_samples - batch_size < len(yielded) <= num_samples
        assert set(yielded) == set(plan.order[: len(yielded)].tolist())
    else:
        assert sorted(yielded) == list(range(num_samples))


# --------------------------------------------------------------------------- prefetch_depth


def test_prefetch_depth():
    """Lookahead = Lightning's one-batch prefetch + the workers' queued index batches."""
    assert prefetch_depth(0, None) == 1
    assert prefetch_depth(0, 8) == 1  # prefetch_factor is irrelevant without workers
    assert prefetch_depth(2, None) == 1 + 2 * 2
    assert prefetch_depth(3, 4) == 1 + 12


@PROPERTY
@given(
    world=st.integers(2, 8),
    batch_size=st.integers(3, 16),
    remaining=st.integers(1, 400),
    request=st.lists(st.integers(1, 50), min_size=8, max_size=8),
)
def test_final_window_never_leaves_a_one_sample_batch(world, batch_size, remaining, request):
    """A batch of one sample breaks BatchNorm in training; the final split never creates one.

    Whole batches go out in proportion to the plan, the tail to the rank with most batches, and
    a one-sample tail becomes two partial batches of at least two samples on two ranks.
    """
    if remaining < world * batch_size:
        return  # fewer whole batches than ranks: the sample-level fallback applies
    plan = make_plan(world, batch_size, 1, drop_last=False, num_samples=remaining)
    plan.freeze([s * 1000 for s in request[:world]])  # far more than remains: the final window
    assert plan.complete and sum(plan.sizes[0]) == remaining
    for size in plan.sizes[0]:
        assert size >= 2 and size % batch_size != 1
    assert sum(1 for size in plan.sizes[0] if size % batch_size) <= 2
