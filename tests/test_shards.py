"""Sharded iterables under ElChe: the protocol's description and refusals, reading shards forward,
whole shards claimed by speed (simulated ranks with a real store counter), and on real processes
every item once per epoch at each rank's speed, with DataLoader workers and across a resume on
more ranks."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import TESTS, crash_and_resume_on_three_ranks, train_with_rank_1_slowing_mid_epoch
from torch.utils.data import DataLoader, IterableDataset

from lightning_elche.cohort.train_data import TrainData
from lightning_elche.cohort.claims import Claiming
from lightning_elche.cohort.pool import PoolEpoch
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.lightning.data import ElCheSampler, describe_train_loader
from lightning_elche.lightning.shards import ShardItems

from test_dispatch import run

sys.path.insert(0, str(TESTS))
from scenario import ShardedIndexedDataset  # noqa: E402

SAMPLES = 600  # shards of 37, 64, 50, 81, 23, 70 items, repeated
BASE = {"dataset": "shards", "samples": SAMPLES, "batch_size": 8, "epochs": 2}


class CountingShard:
    """Items ``[start, end)``, counting every item read (what a tar file or a record file costs)."""

    def __init__(self, start: int, end: int, reads: list[int]) -> None:
        self.start, self.end, self.reads = start, end, reads

    def __iter__(self):
        for item in range(self.start, self.end):
            self.reads[0] += 1
            yield item

    def __len__(self) -> int:
        return self.end - self.start


class Records(IterableDataset):
    def __init__(self, sizes, reads=None, shuffle_shards=True):
        self.reads = reads if reads is not None else [0]
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        self._shards = [CountingShard(a, b, self.reads) for a, b in zip(bounds, bounds[1:])]
        self.shuffle_shards = shuffle_shards

    def shards(self):
        return self._shards

    def __iter__(self):
        return (item for shard in self._shards for item in shard)


def test_a_sharded_iterable_is_described_by_its_shards():
    loader = DataLoader(ShardedIndexedDataset(SAMPLES), batch_size=8)
    data, _ = describe_train_loader(loader, 2, None)
    assert data.num_samples == SAMPLES and data.sequential_chunks and data.shuffle and data.seed == 0
    assert data.chunks[:3] == ((0, 37), (37, 101), (101, 151)) and data.chunks[-1][1] == SAMPLES
    assert data.samples_per_step == 16
    assert describe_train_loader(loader, 1, 11)[0].seed == 11  # ElCheStrategy(seed=...) wins
    assert not describe_train_loader(DataLoader(Records([5, 5], shuffle_shards=False), batch_size=2), 1, None)[0].shuffle


class NoLength(IterableDataset):
    def shards(self):
        return [iter(range(3)), iter(range(3))]

    def __iter__(self):
        return iter(range(6))


class NoShards(NoLength):
    def shards(self):
        return []


def test_one_shot_shards_or_no_shards_are_refused_saying_what_is_needed():
    with pytest.raises(ValueError, match=r"NoShards.shards\(\) as a non-empty list of shards.*\(empty\)"):
        describe_train_loader(DataLoader(NoShards(), batch_size=2), 1, None)
    one_shot = r"shard 0 \(range_iterator\) is an iterator.*iter\(\) must start from its first item"
    with pytest.raises(ValueError, match=one_shot), pytest.warns(UserWarning, match="no len"):
        describe_train_loader(DataLoader(NoLength(), batch_size=2), 1, None)


class Unsized:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_shards_without_len_are_counted_once_by_reading_them_with_a_warning():
    dataset = Records([5, 7, 3])
    dataset._shards[1] = Unsized(range(5, 12))
    with pytest.warns(UserWarning, match=r"1 of Records's 3 shards have no len\(\).*reads them once to count"):
        data, _ = describe_train_loader(DataLoader(dataset, batch_size=2), 1, None)
    assert data.chunks == ((0, 5), (5, 12), (12, 15)) and dataset.reads == [0]  # the sized ones are not read


def test_shard_items_read_each_shard_forward_and_reopen_it_only_to_go_back():
    dataset = Records([10, 10])
    items = ShardItems(dataset.shards(), ((0, 10), (10, 20)))
    assert [items[i] for i in (0, 1, 2, 5, 6, 12, 13)] == [0, 1, 2, 5, 6, 12, 13]
    assert dataset.reads == [7 + 4]  # 3 and 4 read past; shard 1 opened at 12 (10 and 11 read past)
    assert items[1] == 1 and dataset.reads == [13]  # going back: shard 0 reopened
    clone = pickle.loads(pickle.dumps(items))  # a DataLoader worker opens its own shards
    assert clone._reading is None and clone[19] == 19
    with pytest.raises(IndexError):
        items[20]


def test_a_shard_shorter_than_its_len_is_named():
    class Lying(CountingShard):
        def __len__(self) -> int:
            return 5

    items = ShardItems([Lying(0, 3, [0])], ((0, 5),))
    with pytest.raises(RuntimeError, match=r"shard 0 ended before its item 4: its len\(\) says 5"):
        items[4]


SIZES = [37, 64, 50, 81, 23, 70, 5, 3, 90, 41] * 4  # 1856 items, some shards shorter than a step


def sharded_data(samples_per_step: int = 4, sizes: list[int] = SIZES) -> TrainData:
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    chunks = tuple(zip(bounds, bounds[1:]))
    return TrainData(
        bounds[-1], seed=2, shuffle=True, batch_size=4, samples_per_step=samples_per_step, drop_last=False,
        chunks=chunks, sequential_chunks=True,
    )  # fmt: skip


def reads_per_item(result, data: TrainData) -> float:
    """Items each rank's reader read (skips included) per item trained, as ShardItems reads them."""
    reads, trained = [0], 0
    for rank in result["ranks"]:
        items = ShardItems(Records(SIZES, reads).shards(), data.chunks)
        for index in rank.trained:
            assert items[index] == index
        trained += len(rank.trained)
    return reads[0] / trained


def test_whole_shards_go_to_ranks_by_speed_and_are_read_once():
    data = sharded_data()
    result = run(3, data.num_samples, lambda rank, step: [1.0, 2.0, 4.0][rank], data=data, epochs=2)
    trained = sorted(i for r in result["ranks"] for i in r.trained)
    assert trained == sorted(list(range(data.num_samples)) * 2)
    steps = [r.steps for r in result["ranks"]]
    assert steps[0] > 1.5 * steps[1] > 1.5 * 1.2 * steps[2], steps
    assert reads_per_item(result, data) < 1.05  # a shard is read by one rank, forward, besides a step's overlap
    assert isinstance(result["ranks"][0].cohort.plan, PoolEpoch)


def test_near_the_epochs_end_a_slow_rank_leaves_the_last_shards_to_the_fast_one():
    """A shard takes the slow rank 16 of its steps and its prefetch holds claims long, so before each
    claim it hears what the fast rank claimed meanwhile; the fast rank barely waits (without hearing: 9 %)."""
    data = sharded_data(sizes=[64] * 32)
    result = run(2, data.num_samples, lambda rank, step: [10.0, 30.0][rank], data=data, prefetch=5, epochs=2)
    fast = result["ranks"][0]
    assert fast.idle_ms / fast.now < 0.05, fast.idle_ms / fast.now


def test_a_mid_epoch_checkpoint_of_whole_shard_claims_resumes_on_three_ranks_with_what_is_left():
    data = sharded_data()
    first = run(2, data.num_samples, lambda rank, step: 1.0 + 2 * rank, prefetch=5, checkpoint_at=5, data=data)
    point = first["checkpoint"]
    before = sorted(i for trained in first["trained_at_checkpoint"] for i in trained)
    assert sorted(data.samples_at(0, point.covered).tolist()) == before
    assert sorted(point.covered_samples(data=data).tolist()) == before
    resumed = run(3, data.num_samples, lambda rank, step: 1.0 + rank, resume=ResumePoint.from_state(point.to_state()), data=data)
    after = [i for r in resumed["ranks"] for i in r.trained]
    assert sorted(before + after) == list(range(data.num_samples))
    assert reads_per_item(resumed, data) < 1.1  # partly trained shards are read from where they stopped


@pytest.mark.parametrize("lanes, reads_per_item", [(1, (1.5, 2.0)), (2, (1.0, 1.1))])
def test_with_a_lane_per_dataloader_worker_each_worker_reads_its_own_shards_forward(lanes, reads_per_item):
    """Workers get batches in turn: with one lane, both read (and skip) every shard; with a lane each,
    each reads its own shards, and the rank trains the same items."""
    data = sharded_data()
    plan = data.plan(0, world_size=2, dynamic=True)
    plan.open_windows(0, lambda: [50, 50], rank=0, lookahead_batches=1, window_cap=lambda ahead: None)
    sampler = ElCheSampler(lambda epoch: plan, rank=0, claiming=Claiming(TicketCounter(dist.HashStore(), 2, answer_within_s=60), lanes=lanes))
    indices = list(sampler)
    batches = [indices[i : i + 4] for i in range(0, len(indices), 4)]
    reads = [0]
    workers = [ShardItems(Records(SIZES, reads).shards(), data.chunks) for _ in range(2)]
    for number, batch in enumerate(batches):
        assert [workers[number % 2][i] for i in batch] == batch
    low, high = reads_per_item
    assert low <= reads[0] / len(indices) < high  # a step's overlap into the next shard is read twice
    reserved = data.samples_at(0, plan.covered([plan.claims()])).tolist()  # rank 1's first shard, not held here
    assert reserved and sorted(indices + reserved) == list(range(data.num_samples))
    assert len(plan.held) == len(indices) // 4  # every ticket handed out, in the order it would be trained


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "2-workers"])
def test_every_item_once_per_epoch_at_each_ranks_speed(tmp_path, workers):
    """Whole shards by speed as rank 1 slows down: every item once per epoch, most to the fast rank."""
    train_with_rank_1_slowing_mid_epoch(tmp_path, **BASE, num_workers=workers, elche={"anchor": 4})


@pytest.mark.timeout(300)
def test_a_mid_epoch_checkpoint_resumes_on_three_ranks_with_every_item_once(tmp_path):
    """Shards without len() here: both fits count them first, 2 and then 3 ranks sharing the reading."""
    config = {
        **BASE, "shard_lengths": False, "slow": {"1": 2.0}, "elche": {"anchor": 2, "max_anchor": 2},
        "checkpoint_every_n_steps": 1, "checkpoint_save_last": True,
    }  # fmt: skip
    crash_and_resume_on_three_ranks(tmp_path, **config)
