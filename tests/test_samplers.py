"""A custom train sampler or batch sampler under ElChe: the epoch's order is the sampler's draw (a batch
sampler's batches), trained once across ranks.

A ``WeightedRandomSampler`` (imbalanced classes: the second half of the set three times as likely as
the first, drawn with replacement) on two ranks, rank 1 three times slower: each epoch's draws are
trained exactly once across the ranks, whatever their shares (a sample drawn twice is trained twice,
as under DDP), and a mid-epoch checkpoint resumes on three ranks with the rest of that draw. A
length-bucketing ``batch_sampler`` likewise: its batches are handed out whole, each bucket of one length.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from conftest import CRASH_EXIT_CODE, assert_consensus, local_steps, run_scenario
from scenario import IndexedDataset, LengthBuckets, length_class, weighted_sampler
from torch.utils.data import DistributedSampler, SequentialSampler

from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.lightning.data import BatchUnits, SamplerDraws

SAMPLES, EPOCHS = 512, 2
CONFIG: dict[str, Any] = {
    "samples": SAMPLES, "batch_size": 8, "epochs": EPOCHS, "sampler": "weighted", "slow": {"1": 3.0},
    "slow_clock": "wall",
}  # fmt: skip


def drawn(epoch: int) -> Counter:
    """The sampler's draw of ``epoch`` as ElChe replays it (seed 0: the scenario's seed_everything)."""
    return Counter(SamplerDraws(weighted_sampler(SAMPLES))(epoch, 0).tolist())


def trained(results: list[dict[str, Any]], epoch: int) -> Counter:
    return Counter(index for result in results for index in result["trained"].get(str(epoch), []))


@pytest.mark.timeout(300)
def test_each_draw_of_a_weighted_sampler_is_trained_once_across_ranks(tmp_path):
    ddp = run_scenario(tmp_path / "ddp", strategy="ddp", **CONFIG)
    elche = run_scenario(tmp_path / "elche", **CONFIG)
    assert all(result["exception"] is None for result in ddp + elche), [r["exception_message"] for r in ddp + elche]
    assert_consensus(elche)
    assert local_steps(elche[0]) > local_steps(elche[1])  # 3x slower in wall time: uneven shares, a wide margin
    for epoch in range(EPOCHS):
        assert trained(elche, epoch) == drawn(epoch), epoch
        for run in (ddp, elche):  # the weighting holds: about 3 draws of the second half to 1 of the first
            counts = trained(run, epoch)
            first = sum(c for index, c in counts.items() if index < SAMPLES // 2)
            assert sum(counts.values()) == SAMPLES and SAMPLES - first > 2 * first, (epoch, first)
    assert drawn(0) != drawn(1)  # a new draw each epoch, as DDP's sampler makes
    assert elche[0]["global_step"] == ddp[0]["global_step"] == EPOCHS * SAMPLES // 16


def crash_and_resume_on_three(tmp_path, config: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two ranks crash after their fourth checkpoint (step 10, inside epoch 0: ``save_last`` counts), and the
    fit resumes from ``last.ckpt`` on three: what each crashed rank had trained, and the resumed results."""
    config = {**config, "checkpoint_every_n_steps": 5, "checkpoint_save_last": True}
    crashed = run_scenario(tmp_path / "crashed", expect_failure=True, crash_after_checkpoints=4, **config)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = tmp_path / "crashed" / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(2)]
    assert {snapshot["global_step"] for snapshot in snapshots} == {10}
    resumed = run_scenario(tmp_path / "resumed", devices=3, ckpt_path=str(out / "checkpoints" / "last.ckpt"), **config)
    assert all(result["exception"] is None for result in resumed), [r["exception_message"] for r in resumed]
    assert_consensus(resumed, initial_step=10)
    return snapshots, resumed


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_on_three_ranks_trains_the_rest_of_the_draw(tmp_path):
    snapshots, resumed = crash_and_resume_on_three(tmp_path, CONFIG)
    for epoch in range(EPOCHS):
        assert trained(snapshots + resumed, epoch) == drawn(epoch), epoch


BUCKETS: dict[str, Any] = {**CONFIG, "sampler": None, "batch_sampler": "buckets"}
# The lengths over the whole epoch: 172, 170 and 170 samples, so 21 + 21 + 21 full batches of 8 and one partial
# batch per length (4, 2 and 2 samples): 66 units, 33 DDP-equivalent steps per epoch; under DDP each rank
# buckets its 256 samples into 33 batches (its partial ones: one per length too).
BUCKET_SIZES = [2, 2, 4] + [8] * 63


def batches_of(result: dict[str, Any], epoch: int) -> list[list[int]]:
    """``result``'s batches of ``epoch`` (its step batches, cut where its epochs' samples are)."""
    start = sum(len(result["trained"].get(str(e), [])) for e in range(epoch))
    end = start + len(result["trained"].get(str(epoch), []))
    batches, seen = [], 0
    for batch in result["step_batches"]:
        if start <= seen < end:
            batches.append(batch)
        seen += len(batch)
    return batches


def assert_whole_buckets(results: list[dict[str, Any]], epoch: int) -> None:
    """The epoch's batches across the ranks are the buckets of the whole epoch's samples, each trained whole
    and once: one length per batch, every sample once, and only one partial batch per length (a bucket split
    between ranks, or bucketed per rank, would leave more)."""
    batches = [batch for result in results for batch in batches_of(result, epoch)]
    assert all(len({length_class(index) for index in batch}) == 1 for batch in batches), epoch
    assert sorted(index for batch in batches for index in batch) == list(range(SAMPLES)), epoch
    assert sorted(len(batch) for batch in batches) == BUCKET_SIZES, (epoch, sorted(len(batch) for batch in batches))


@pytest.mark.timeout(300)
def test_a_bucketing_batch_sampler_keeps_its_batches_whole_and_each_is_trained_once(tmp_path):
    """Each epoch trains the batches the bucketing sampler made of the whole epoch's order, each whole on one
    rank and once, the slow rank fewer; as many DDP-equivalent steps as DDP's (its ranks bucket their halves)."""
    ddp = run_scenario(tmp_path / "ddp", strategy="ddp", **BUCKETS)
    elche = run_scenario(tmp_path / "elche", **BUCKETS)
    assert all(result["exception"] is None for result in ddp + elche), [r["exception_message"] for r in ddp + elche]
    assert_consensus(elche)
    assert local_steps(elche[0]) > local_steps(elche[1])
    drawn_batches = [{tuple(batch) for result in elche for batch in batches_of(result, epoch)} for epoch in range(EPOCHS)]
    assert drawn_batches[0] != drawn_batches[1]  # each epoch its own draw (seeded per epoch), as under DDP
    for epoch in range(EPOCHS):
        assert_whole_buckets(elche, epoch)
        for result in ddp:  # DDP's ranks bucket their halves: one length per batch too, every sample once
            assert all(len({length_class(index) for index in batch}) == 1 for batch in batches_of(result, epoch))
        assert sorted(trained(ddp, epoch).elements()) == list(range(SAMPLES)), epoch
    # 66 units an epoch are 33 DDP-equivalent steps. DDP's ranks bucket their own shuffled halves, so a rank
    # may have a partial batch more than the other in an epoch (67 steps were seen): at most one per epoch.
    assert elche[0]["global_step"] == EPOCHS * len(BUCKET_SIZES) // 2
    assert ddp[0]["global_step"] - elche[0]["global_step"] in range(EPOCHS + 1), ddp[0]["global_step"]


@pytest.mark.timeout(300)
def test_a_bucketing_batch_sampler_resumes_mid_epoch_on_three_ranks_with_the_batches_left(tmp_path):
    snapshots, resumed = crash_and_resume_on_three(tmp_path, BUCKETS)
    for epoch in range(EPOCHS):
        assert sorted(trained(snapshots + resumed, epoch).elements()) == list(range(SAMPLES)), epoch
    assert_whole_buckets(resumed, 1)


def bucket_units() -> BatchUnits:
    dataset = IndexedDataset(SAMPLES)
    whole = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return BatchUnits(LengthBuckets(SequentialSampler(dataset), batch_size=8, drop_last=False), whole)


def test_a_batch_samplers_units_are_drawn_alike_on_every_rank_and_anew_each_epoch():
    """What every rank and a resumed run replay: the same batches for an epoch and seed, new ones each epoch."""
    units = bucket_units()
    assert units(0, 0) == bucket_units()(0, 0) and units(0, 0) != units(1, 0) and units(0, 0) != units(0, 1)
    assert sorted(len(batch) for batch in units(1, 0)) == BUCKET_SIZES
    data = TrainData(len(units(0, 0)), seed=0, shuffle=False, batch_size=1, samples_per_step=1, drop_last=False, units=units)
    assert data.base_order(1).tolist() == list(range(len(BUCKET_SIZES)))
    assert data.samples_at(1, Spans(((2, 4),))).tolist() == [*units(1, 0)[2], *units(1, 0)[3]]
    assert data.drawn_digest(0) != data.drawn_digest(1)  # a checkpoint tells a resume whose batches differ


def test_a_batch_sampler_whose_batch_count_changes_between_epochs_is_refused_naming_what_to_do():
    batches = {0: [[0, 1], [2]], 1: [[0], [1], [2]]}
    data = TrainData(2, seed=0, shuffle=False, batch_size=1, samples_per_step=1, drop_last=False,
                     units=lambda epoch, seed: batches[epoch])  # fmt: skip
    assert data.base_order(0).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"made 3 batches in epoch 1 and 2 in the fit's first.*drop_last=True"):
        data.base_order(1)
