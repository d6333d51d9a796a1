"""LitData StreamingDataset under ElChe, on real processes: every item exactly once per epoch at each
rank's speed (planned and dynamic dispatch, DataLoader workers), across a mid-epoch resume on more
ranks; and what is refused in-process, with the forms that are supported."""

from __future__ import annotations

import sys

import litdata
import pytest
import torch
from conftest import TESTS, crash_and_resume_on_three_ranks, train_with_rank_1_slowing_mid_epoch
from torch.utils.data import DataLoader, IterableDataset

from lightning_elche.lightning.data import describe_train_loader


SAMPLES = 600  # 75 batches of 8; chunks of 64 items, the last one short
BASE = {"dataset": "litdata", "samples": SAMPLES, "batch_size": 8, "epochs": 2}


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory) -> str:
    """The scenario's 600 items written in LitData's chunk format, 64 per chunk (LitData's own writer,
    in-process: ``litdata.optimize`` would switch this process's start method to spawn)."""
    from litdata.streaming import Cache

    sys.path.insert(0, str(TESTS))
    from scenario import IndexedDataset

    dataset = IndexedDataset(SAMPLES, seed=0)
    out = tmp_path_factory.mktemp("litdata") / "optimized"
    cache = Cache(str(out), chunk_size=64)
    for index in range(SAMPLES):
        cache[index] = dataset[index]
    cache.done()
    cache.merge()
    return str(out)


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
    config = {
        **BASE, "litdata_dir": litdata_dir, "slow": {"1": 2.0}, "elche": {"anchor": 2, "max_anchor": 2},
        "checkpoint_every_n_steps": 1, "checkpoint_save_last": True,
    }  # fmt: skip
    checkpoint, _ = crash_and_resume_on_three_ranks(tmp_path, **config)
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]
    assert state["schema_version"] == 3 and state["covered"].shape[0] <= 3  # a few spans, not a bit per item


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
