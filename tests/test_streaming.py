"""LitData StreamingDataset under ElChe, on real processes: every item exactly once per epoch at each
rank's speed (planned and dynamic dispatch, DataLoader workers), across a mid-epoch resume on more
ranks; and what is refused in-process, with the forms that are supported."""

from __future__ import annotations

import json
from collections import Counter

import litdata
import pytest
import torch
from conftest import (
    CRASH_EXIT_CODE,
    assert_consensus,
    assert_trained_once_each,
    crash_and_resume_on_three_ranks,
    local_steps,
    run_scenario,
    train_with_rank_1_slowing_mid_epoch,
    write_litdata,
)
from torch.utils.data import DataLoader, IterableDataset

from scenario import PAIRED, pair

from lightning_elche.lightning.data import describe_train_loader, with_sampler
from lightning_elche.cohort.order import ENDLESS_POSITIONS, PositionRange
from lightning_elche.lightning.streaming import shared_remote_chunks


SAMPLES = 600  # 75 batches of 8; chunks of 64 items, the last one short
BASE = {"dataset": "litdata", "samples": SAMPLES, "batch_size": 8, "epochs": 2}
# a checkpoint at every boundary of a fit with rank 1 twice slower (crash_and_resume_on_three_ranks)
CHECKPOINTED = {"slow": {"1": 2.0}, "elche": {"anchor": 2, "max_anchor": 2}, "checkpoint_every_n_steps": 1, "checkpoint_save_last": True}


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory) -> str:
    """The scenario's items in LitData's chunk format, 64 per chunk."""
    return write_litdata(tmp_path_factory.mktemp("litdata") / "optimized", range(SAMPLES))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "dispatch, workers", [("dynamic", 0), ("dynamic", 2), ("planned", 2)], ids=["dynamic", "dynamic-2-workers", "planned-2-workers"]
)
def test_every_item_once_per_epoch_at_each_ranks_speed(tmp_path, litdata_dir, dispatch, workers):
    """Rank 1 turns 6x slower a few steps into the epoch: shares change mid-epoch, every item of
    every epoch is still trained exactly once, and the fast rank trains most of them."""
    train_with_rank_1_slowing_mid_epoch(
        tmp_path, **BASE, litdata_dir=litdata_dir, num_workers=workers, elche={"dispatch": dispatch, "anchor": 4}
    )


@pytest.mark.timeout(300)
def test_a_mid_epoch_checkpoint_resumes_on_three_ranks_with_every_item_once(tmp_path, litdata_dir):
    checkpoint, _ = crash_and_resume_on_three_ranks(tmp_path, **BASE, litdata_dir=litdata_dir, **CHECKPOINTED)
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]
    assert state["schema_version"] == 3 and state["covered"].shape[0] <= 3  # a few spans, not a bit per item


@pytest.mark.timeout(300)
def test_a_remote_dataset_gives_each_chunk_to_the_one_rank_that_downloads_it(tmp_path, litdata_dir):
    """The dataset read as remote storage (LitData's ``local:`` scheme: each chunk copied into the rank's
    own cache on first read, as from ``s3://``), two DataLoader workers: dynamic dispatch claims whole
    chunks, so every chunk is downloaded by one rank only, every item is trained once, and the fast rank
    still trains most of the epoch. (Chunks of 64 items are whole steps of 8: no step spans two chunks.)"""
    train_with_rank_1_slowing_mid_epoch(
        tmp_path, **{**BASE, "epochs": 1}, litdata_dir=litdata_dir, litdata_remote=True, num_workers=2,
        elche={"dispatch": "dynamic", "anchor": 4},
    )  # fmt: skip
    caches = [tmp_path / "out" / "litdata-cache" / f"rank{rank}" for rank in range(2)]
    downloaded = [{path.name for path in cache.rglob("chunk-*.bin")} for cache in caches]
    assert not downloaded[0] & downloaded[1], downloaded
    assert downloaded[0] | downloaded[1] == {f"chunk-0-{chunk}.bin" for chunk in range(-(-SAMPLES // 64))}


def test_remote_chunks_shared_between_ranks_are_named_in_a_warning(litdata_dir):
    """Planned dispatch cuts a remote dataset's chunks between ranks (each downloads what it reads): said,
    with the way out; dynamic dispatch claims them whole; a local dataset downloads nothing; a combined
    dataset with a remote part reads its chunks item by item, shared: said."""
    remote = litdata.StreamingDataLoader(litdata.StreamingDataset(f"local:{litdata_dir}"), batch_size=8)
    data, _ = describe_train_loader(remote, 1, None)
    assert data.remote_chunks and data.claims_whole_chunks
    warning = shared_remote_chunks(remote.dataset, dynamic=False)
    assert warning is not None and f"local:{litdata_dir}" in warning and "Dynamic dispatch" in warning
    assert shared_remote_chunks(remote.dataset, dynamic=True) is None
    local = litdata.StreamingDataLoader(litdata.StreamingDataset(litdata_dir), batch_size=8)
    local_data, _ = describe_train_loader(local, 1, None)
    assert not local_data.remote_chunks and shared_remote_chunks(local.dataset, dynamic=False) is None
    combined = litdata.CombinedStreamingDataset([litdata.StreamingDataset(litdata_dir), remote.dataset])
    warning = shared_remote_chunks(combined, dynamic=True)  # read item by item, interleaved: chunks shared
    assert warning is not None and f"local:{litdata_dir}" in warning and "CombinedStreamingDataset" in warning


class Unsharded(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_an_iterable_that_is_not_a_streaming_dataset_is_refused_naming_the_supported_forms():
    with pytest.raises(ValueError, match=r"IterableDataset \(Unsharded\).*map-style Dataset.*LitData StreamingDataset"):
        describe_train_loader(DataLoader(Unsharded(), batch_size=2), 1, None)


def test_a_streaming_loader_is_described_by_its_chunks(litdata_dir):
    loader = litdata.StreamingDataLoader(litdata.StreamingDataset(litdata_dir, shuffle=True, seed=5), batch_size=8)
    data, lookahead = describe_train_loader(loader, 2, None)
    assert data.num_samples == SAMPLES and data.seed == 5 and data.shuffle and data.samples_per_step == 16
    assert data.chunks[0] == (0, 64) and data.chunks[-1] == (576, 600) and len(data.chunks) == 10
    assert lookahead == 1 and data.chunk_block == 256  # LitData's default in-chunk shuffle block
    assert describe_train_loader(loader, 1, 11)[0].seed == 11  # ElCheStrategy(seed=...) wins


# ------------------------------------------------------------------ LitData's CombinedStreamingDataset

SPLIT = 384  # the first dataset's items 0..383 (chunks of 64), the second's 384..599 (chunks of 48)


@pytest.fixture(scope="module")
def combined_dirs(tmp_path_factory) -> tuple[str, str]:
    """The scenario's 600 items in two LitData datasets of different sizes and chunk sizes."""
    root = tmp_path_factory.mktemp("combined")
    return write_litdata(root / "first", range(SPLIT)), write_litdata(root / "second", range(SPLIT, SAMPLES), chunk_size=48)


def combined_loader(dirs: tuple[str, str], batch_size: int = 8, **combined) -> litdata.StreamingDataLoader:
    parts = [litdata.StreamingDataset(folder, shuffle=True, seed=3) for folder in dirs]
    return litdata.StreamingDataLoader(litdata.CombinedStreamingDataset(parts, seed=3, **combined), batch_size=batch_size)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching", ["stratified", "per_stream"])
def test_a_combined_streaming_dataset_trains_every_item_of_every_dataset_once_at_each_ranks_speed(
    tmp_path, combined_dirs, batching
):
    """LitData's default (iterate_over_all): each epoch is every item of both datasets once, split by
    speed (rank 1 turns 6x slower). ``per_stream``: every batch is one dataset's, but the epoch's last
    (where the datasets' partial batches meet: 384 = 48 x 8, 216 = 27 x 8, so none here)."""
    results = train_with_rank_1_slowing_mid_epoch(
        tmp_path, **{**BASE, "litdata_dir": None}, litdata_combined=combined_dirs, combined_batching=batching,
        elche={"dispatch": "dynamic", "anchor": 4},
    )  # fmt: skip
    batches = [batch for result in results for batch in result["step_batches"]]
    mixed = [batch for batch in batches if len({index < SPLIT for index in batch}) > 1]
    if batching == "per_stream":
        assert mixed == [], mixed[:5]
    else:  # items drawn one at a time: most batches of 8 hold both datasets (216 of 600 items are the second's)
        assert len(mixed) > len(batches) / 2, (len(mixed), len(batches))


def test_a_combined_epoch_order_is_each_datasets_own_interleaved(combined_dirs):
    data, _ = describe_train_loader(combined_loader(combined_dirs), 1, None)
    assert data.num_samples == SAMPLES and data.seed == 3 and data.drawn is not None
    first, again, other = data.drawn(0, 3), data.drawn(0, 3), data.drawn(1, 3)
    assert sorted(first.tolist()) == list(range(SAMPLES)) and torch.equal(first, again) and not torch.equal(first, other)
    alone = litdata.StreamingDataLoader(litdata.StreamingDataset(combined_dirs[0], shuffle=True, seed=3), batch_size=8)
    own = describe_train_loader(alone, 1, None)[0].base_order(0)[:]
    assert torch.equal(first[first < SPLIT], own)  # the first dataset's items come in its own order as ElChe reads it
    per_stream = describe_train_loader(combined_loader(combined_dirs, batching_method="per_stream"), 1, None)[0]
    batches = per_stream.drawn(0, 3).view(-1, 8)
    assert all(len({bool(i < SPLIT) for i in batch.tolist()}) == 1 for batch in batches)


def test_a_weighted_combined_epoch_ends_where_litdata_ends_it(combined_dirs):
    """``weights`` with ``iterate_over_all=False``: items drawn with the weights until a dataset with nothing
    left is drawn; that dataset was trained whole, no item twice, and the epochs differ in length."""
    data, _ = describe_train_loader(combined_loader(combined_dirs, weights=(0.5, 0.5), iterate_over_all=False), 1, None)
    lengths = set()
    for epoch in range(4):
        order = data.drawn(epoch, 3).tolist()
        second = [i for i in order if i >= SPLIT]
        assert len(set(order)) == len(order) and len(second) == SAMPLES - SPLIT, epoch  # the smaller one ran out
        assert 0.7 * len(second) < len(order) - len(second) < len(second) * 1.4, epoch  # about as many of the first
        lengths.add(len(order))
    assert len(lengths) > 1
    plan = data.plan(0, 2)
    assert len(plan.order) == len(data.drawn(0, 3))  # the plan trains what was drawn, nothing more


@pytest.mark.timeout(300)
def test_a_weighted_combined_fit_trains_each_drawn_item_once(tmp_path, combined_dirs):
    results = run_scenario(
        tmp_path, **{**BASE, "litdata_dir": None}, litdata_combined=combined_dirs, combined_weights=(0.5, 0.5),
        slow={"1": 3.0}, elche={"anchor": 4},
    )  # fmt: skip
    data, _ = describe_train_loader(combined_loader(combined_dirs, weights=(0.5, 0.5), iterate_over_all=False), 1, 0)
    assert_trained_once_each(results, BASE["epochs"], lambda epoch: data.drawn(epoch, 0).tolist())
    assert_consensus(results)


@pytest.mark.timeout(300)
def test_a_combined_mid_epoch_checkpoint_resumes_on_three_ranks_with_every_item_once(tmp_path, combined_dirs):
    crash_and_resume_on_three_ranks(tmp_path, **BASE, litdata_combined=combined_dirs, **CHECKPOINTED)


# ------------------------------------------------------------------ LitData's ParallelStreamingDataset
# The combined test's two datasets zipped: 384 items (chunks of 64) beside 216 (chunks of 48).


def parallel_loader(dirs: tuple[str, str], seed: int = 0, **parallel) -> litdata.StreamingDataLoader:
    """The scenario's ParallelStreamingDataset (``tests/scenario.py``): ``pair`` folds both indices into one."""
    parts = [litdata.StreamingDataset(folder, shuffle=True, seed=seed) for folder in dirs]
    return litdata.StreamingDataLoader(litdata.ParallelStreamingDataset(parts, seed=seed, transform=pair, **parallel), batch_size=8)


def zipped(loader: litdata.StreamingDataLoader, endless_epoch: int | None = None) -> tuple[object, list]:
    """The loader as ElChe plans it, and the map-style view its ranks read (a sample per stream position)."""
    data, _ = describe_train_loader(loader, 1, None, endless_epoch)
    return data, with_sampler(loader, data, None, 8).dataset


def own_order(folder: str, seed: int, epoch: int) -> list[int]:
    """A StreamingDataset's items (numbered in it from 0) in ElChe's order of ``epoch`` with ``seed``."""
    alone = litdata.StreamingDataLoader(litdata.StreamingDataset(folder, shuffle=True, seed=seed), batch_size=8)
    return describe_train_loader(alone, 1, None)[0].base_order(epoch)[:].tolist()


def test_a_parallel_epoch_zips_its_datasets_orders_up_to_the_shortest(combined_dirs):
    """``length=None``: an epoch is the shorter dataset's 216 positions; position ``i`` pairs item ``i`` of
    each dataset's order of the epoch, as LitData's iterator zips them; each epoch its own orders."""
    data, view = zipped(parallel_loader(combined_dirs))
    assert data.num_samples == SAMPLES - SPLIT and data.seed == 0
    assert data.drawn(0, 0).tolist() == list(range(216)) and data.drawn(1, 0).tolist() == list(range(216, 432))
    for epoch in range(2):
        pairs = [divmod(int(view[p][2]), PAIRED) for p in data.drawn(epoch, 0)]
        assert [first for first, _ in pairs] == own_order(combined_dirs[0], 0, epoch)[:216], epoch  # the dataset's place: + 0
        assert [second - SPLIT for _, second in pairs] == own_order(combined_dirs[1], 1, epoch), epoch  # + 1
    again = zipped(parallel_loader(combined_dirs))[1]
    assert torch.equal(view[5][0], again[5][0]) and not torch.equal(view[5][0], view[5 + 216][0])  # the transform's draw


@pytest.mark.parametrize("resume", [True, False])
def test_a_cycled_parallel_stream_goes_on_across_epochs_or_starts_again(combined_dirs, resume):
    """``length=600``: both datasets cycle, each cycle a new order; ``resume=True`` carries the stream on
    into the next epoch (epoch 1 begins with the first dataset's 600th item), ``resume=False`` starts
    every epoch at the stream's beginning (the same samples)."""
    data, view = zipped(parallel_loader(combined_dirs, length=600, resume=resume))
    assert data.num_samples == 600
    stream = [divmod(int(view[p][2]), PAIRED) for epoch in range(2) for p in data.drawn(epoch, 0)]
    firsts, seconds = [f for f, _ in stream], [s - SPLIT for _, s in stream]  # each dataset's own item numbers
    if resume:
        assert firsts[:1152] == [i for cycle in range(3) for i in own_order(combined_dirs[0], 0, cycle)]
        assert seconds[:1080] == [i for cycle in range(5) for i in own_order(combined_dirs[1], 1, cycle)]
    else:
        assert stream[:600] == stream[600:]
        assert firsts[:600] == own_order(combined_dirs[0], 0, 0) + own_order(combined_dirs[0], 0, 1)[:216]


def test_an_endless_parallel_stream_is_one_epoch_of_the_positions_the_fit_trains(combined_dirs):
    """``length=float("inf")``: the stream goes on through the datasets' cycles without end, so its epoch is
    the positions the fit trains (DDP's ``max_steps x world x batch x accumulation``, computed by the
    dispatch): the same stream as a cycled dataset of that length, resumed. Without ``max_steps`` the epoch
    is endless, as under DDP: ``ENDLESS_POSITIONS`` positions, read slice by slice (never held whole), the
    same stream again."""
    endless = parallel_loader(combined_dirs, length=float("inf"))
    data, view = zipped(endless, endless_epoch=480)
    cycled, cycled_view = zipped(parallel_loader(combined_dirs, length=480))
    assert data.num_samples == 480
    assert [int(view[p][2]) for p in data.drawn(0, 0)] == [int(cycled_view[p][2]) for p in cycled.drawn(0, 0)]
    unbounded, unbounded_view = zipped(endless)
    order = unbounded.base_order(0)
    assert unbounded.num_samples == len(order) == ENDLESS_POSITIONS and isinstance(order, PositionRange)
    assert [int(unbounded_view[p][2]) for p in order[:480]] == [int(view[p][2]) for p in data.drawn(0, 0)]
    assert order[ENDLESS_POSITIONS - 2 :].tolist() == [ENDLESS_POSITIONS - 2, ENDLESS_POSITIONS - 1]
    assert unbounded.plan(0, 2, dynamic=True).fingerprint() == unbounded.plan(0, 2, dynamic=True).fingerprint()


@pytest.mark.timeout(300)
def test_an_endless_parallel_stream_trains_each_position_once_up_to_ddps_max_steps(tmp_path, combined_dirs):
    """The LLM loop on an endless stream: ``Trainer(max_steps=25)``, no epoch count, two ranks of batch 8, rank 1
    three times slower: the fit ends at DDP's step 25 on both ranks, having trained the stream's first
    25 x 2 x 8 = 400 positions once each (the first dataset's whole order and the start of its next cycle),
    most of them on the fast rank."""
    results = run_scenario(
        tmp_path, **{**BASE, "epochs": -1}, litdata_parallel=combined_dirs, parallel_length=float("inf"),
        trainer={"max_steps": 25}, slow={"1": 3.0}, slow_clock="wall", step_sleep_ms=12, elche={"anchor": 4},
    )  # fmt: skip
    assert [result["global_step"] for result in results] == [25, 25]
    assert_trained_once_each(results, 1, expected_pairs(combined_dirs, length=400))
    shares = [sum(len(v) for v in result["trained"].values()) for result in results]
    assert shares[0] > 1.5 * shares[1], shares  # the margin of the cycled test above
    assert_consensus(results)


@pytest.mark.timeout(300)
def test_an_endless_stream_without_max_steps_trains_each_position_once_until_the_fit_is_stopped(tmp_path, combined_dirs):
    """No ``max_steps`` (a fit ended by ``max_time``, a stop, or a person): one endless epoch, as under DDP,
    handed out by speed. The user's stop on rank 0 at its 30th batch ends the fit at the next boundary, both
    ranks at one step; every position trained was trained once, and they are the stream's first ones (but
    for the few tickets a rank had claimed and not trained), most of them on the fast rank."""
    results = run_scenario(
        tmp_path, **{**BASE, "epochs": -1}, litdata_parallel=combined_dirs, parallel_length=float("inf"),
        stop_at={"rank": 0, "batch": 30}, slow={"1": 3.0}, slow_clock="wall", step_sleep_ms=12, elche={"anchor": 4},
    )  # fmt: skip
    counted = [local_steps(result) for result in results]  # each rank's steps, as the boundaries counted them
    steps = {result["global_step"] for result in results}  # DDP's step: all ranks' steps over two, rounded down
    assert steps == {sum(counted) // 2} and sum(counted) // 2 >= 30 // 2, ([r["global_step"] for r in results], counted)
    trained = Counter(index for result in results for index in result["trained"]["0"])
    # Every batch trained is in the consensus (assert_consensus below: each rank's batches are the steps its
    # boundaries counted), none past the stopping boundary; an odd total is one batch over global_step * 2.
    assert trained.total() == sum(counted) * BASE["batch_size"], (trained.total(), counted)
    data, view = zipped(parallel_loader(combined_dirs, length=float("inf")))
    # The stream's first positions (a few claimed and not trained aside), each at most once. A sample is a pair
    # of the two datasets' items, which cycle: two positions may pair the same items (as a multiset, then).
    first = Counter(int(view[p][2]) for p in data.base_order(0)[: trained.total() + 8 * BASE["batch_size"]])
    assert not trained - first, trained - first
    shares = [len(result["trained"]["0"]) for result in results]
    assert shares[0] > 1.5 * shares[1], shares
    assert_consensus(results)


def expected_pairs(dirs: tuple[str, str], **parallel) -> object:
    """The pair indices of each epoch's positions, read in this process: what the ranks must train, once each."""
    data, view = zipped(parallel_loader(dirs, **parallel))
    return lambda epoch: [int(view[p][2]) for p in data.drawn(epoch, 0)]


@pytest.mark.timeout(300)
def test_a_cycled_parallel_dataset_trains_each_stream_position_once_at_each_ranks_speed(tmp_path, combined_dirs):
    results = run_scenario(
        tmp_path, **BASE, litdata_parallel=combined_dirs, parallel_length=600, slow={"1": 3.0},
        slow_clock="wall", step_sleep_ms=12, elche={"anchor": 4},  # SLOWED_CONFIG's steps: see below
    )  # fmt: skip
    assert_trained_once_each(results, BASE["epochs"], expected_pairs(combined_dirs, length=600))
    shares = [sum(len(v) for v in result["trained"].values()) for result in results]
    # Margin (tests/test_coverage.py, "Share margins"): k = 3, r = 1.5. With steps that computed and a
    # slowdown on the thread's clock, a loaded clean-clone run measured 704 / 496 = 1.42 (the load stretched
    # the fast rank's steps, not the slowed rank's sleep); with steps that sleep, slowed on the wall clock
    # (SLOWED_CONFIG's recipe), both ranks sleep most of a step and the gap stays near k: 896 / 304 = 2.95
    # measured beside a clean-clone suite run, 2x the bound.
    assert shares[0] > 1.5 * shares[1], shares  # rank 1 is 3x slower: the fast rank trains most positions
    assert_consensus(results)


@pytest.mark.timeout(400)
def test_an_endless_stream_resumed_on_three_ranks_goes_on_from_the_checkpoints_position_to_max_steps(tmp_path, combined_dirs):
    """The endless fit above crashes after its 9th checkpoint (step 9) and resumes from ``last.ckpt`` on three
    ranks. The epoch keeps its length (400 positions, fixed at the fit's start), so the three ranks, training
    more positions a step, finish it and go on into the next epoch of the same stream (positions 400...,
    the stream carried on) until step 25: every position of the first 400 once, none of the next twice."""
    config = {**BASE, "epochs": -1, "litdata_parallel": combined_dirs, "parallel_length": float("inf"),
              "trainer": {"max_steps": 25}, **CHECKPOINTED}  # fmt: skip
    crashed = run_scenario(tmp_path / "crashed", expect_failure=True, crash_after_checkpoints=9, **config)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = tmp_path / "crashed" / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(2)]
    resumed = run_scenario(tmp_path / "resumed", devices=3, ckpt_path=str(out / "checkpoints" / "last.ckpt"), **config)
    assert {result["global_step"] for result in resumed} == {25}
    assert_trained_once_each(snapshots + resumed, 1, expected_pairs(combined_dirs, length=400))
    beyond = [i for result in resumed for i in result["trained"].get("1", [])]
    assert beyond and len(beyond) == len(set(beyond)), beyond
    assert set(beyond) <= set(expected_pairs(combined_dirs, length=400)(1))
    assert_consensus(resumed, initial_step=snapshots[0]["global_step"])


@pytest.mark.timeout(300)
def test_a_parallel_mid_epoch_checkpoint_resumes_on_three_ranks_with_every_position_once(tmp_path, combined_dirs):
    config = {**BASE, "samples": SAMPLES - SPLIT, **CHECKPOINTED}
    crash_and_resume_on_three_ranks(tmp_path, expected=expected_pairs(combined_dirs), litdata_parallel=combined_dirs, **config)
