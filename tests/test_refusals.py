"""Settings that would hang or silently diverge with uneven ranks are refused when ``fit()`` starts.

Which setting is refused is decided by one function, the same on every rank:
``check_fit_configuration`` for Trainer and module settings (refused in ``setup()``) and
``describe_train_loader`` for the train DataLoader (refused when Lightning hands the loader over).
Each setting is therefore checked in-process, against a real ``Trainer`` or ``DataLoader``, with no
process launched. A few cases also run the real two-process scenario (Lightning's own launcher, a
gloo process group), to prove what only real ranks can show: the refusal happens on BOTH ranks,
before anything trains, without either rank hanging in a collective. Those cases are

* several setup problems at once (one error per rank, listing them all),
* ``training_step(dataloader_iter)``, which depends on how Lightning's loop calls the module,
* a ``BatchSampler`` subclass, which Lightning re-instantiates around its own sampler, and
* ``use_distributed_sampler=False``, where Lightning leaves the user's sampler in place.

For each of them the test asserts that

* the run fails (non-zero exit),
* the error is ElChe's and names the setting,
* BOTH ranks raised it (each rank writes ``rank{r}.json`` with its exception in a ``finally``
  block, and torch prefixes each rank's traceback with ``[rank{r}]:`` in the shared stderr),
* no training batch ran on either rank (refused before any collective could diverge), and
* the whole run ended within seconds: far below the scenario's 60 s process-group timeout,
  so neither rank sat in a collective waiting for the other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from conftest import run_scenario
from lightning_elche import ElCheStrategy
from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.lightning.compatibility import check_fit_configuration
from lightning_elche.lightning.data import describe_train_loader, rank_batch_sizes, with_sampler
from scenario import EveryOtherSampler, IndexedDataset, IterableIndexedDataset, make_model

WORLD = 2
NO_HANG_S = 45.0  # the scenario's process-group timeout is 60 s; a refusal takes ~6 s
SETUP_HEADER = "ElCheStrategy cannot train with these settings"


def run_refused(tmp_path: Path, **config: Any) -> dict[str, Any]:
    """Run a scenario that should be refused; return the process, wall time and per-rank results."""
    config = {"epochs": 1, "samples": 64, **config}
    started = time.perf_counter()
    proc = run_scenario(tmp_path, expect_failure=True, timeout=90, **config)
    elapsed = time.perf_counter() - started
    ranks = {}
    for rank in range(WORLD):
        path = tmp_path / "out" / f"rank{rank}.json"
        if path.exists():
            ranks[rank] = json.loads(path.read_text())
    return {"proc": proc, "elapsed": elapsed, "ranks": ranks, "config": config}


def assert_refused_on_every_rank(run: dict[str, Any], *needles: str, exception: str | None = None) -> None:
    proc, ranks = run["proc"], run["ranks"]
    tail = proc.stderr[-6000:]
    assert proc.returncode != 0, f"the run was not refused (exit 0) with {run['config']}:\n{tail}"
    assert run["elapsed"] < NO_HANG_S, f"refusal took {run['elapsed']:.1f} s (a rank hung?):\n{tail}"
    stderr_lines = proc.stderr.splitlines()
    for rank in range(WORLD):
        assert rank in ranks, f"rank {rank} wrote no result (killed before its finally block?):\n{tail}"
        result = ranks[rank]
        message = result["exception_message"] or ""
        assert result["exception"] is not None, f"rank {rank} did not raise:\n{tail}"
        if exception is not None:
            assert result["exception"] == exception, f"rank {rank}: {result['exception']}: {message}"
        assert "ElCheStrategy" in message, f"rank {rank} failed with someone else's error: {message}"
        for needle in needles:
            assert needle in message, f"rank {rank}: {needle!r} not named in {message!r}"
            assert any(line.startswith(f"[rank{rank}]:") and needle in line for line in stderr_lines), (
                f"rank {rank}'s traceback in stderr does not name {needle!r}:\n{tail}"
            )
        # refused before training: no batch ran, no boundary averaged anything
        assert result["step_batches"] == [], f"rank {rank} trained {len(result['step_batches'])} batches first"
        assert result["boundaries"] == []
    # one error per rank, the same on both
    assert ranks[0]["exception"] == ranks[1]["exception"]
    assert ranks[0]["exception_message"] == ranks[1]["exception_message"]


# --------------------------------------------------------------------------- refused in setup()
# Trainer / module settings, refused by ``check_fit_configuration`` with one MisconfigurationException.


class RefusalModule(pl.LightningModule):
    """The scenario's network, with a metric that syncs on every step when asked.

    ``check_fit_configuration`` inspects only the module's structure and ``training_step``
    signature, so nothing here ever trains.
    """

    def __init__(self, model: str = "mlp", metric_sync_on_step: bool = False, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = make_model(model)
        if metric_sync_on_step:
            self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, dist_sync_on_step=True)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return self.net(x).sum()


def fit_configuration_error(
    module: pl.LightningModule, strategy: ElCheStrategy | None = None, **trainer_flags: Any
) -> MisconfigurationException | None:
    """What ``check_fit_configuration`` raises for a two-device ElChe Trainer with ``trainer_flags``
    and ``module``, or None when it accepts them.

    Constructing the Trainer launches no process; ``strategy.connect`` attaches the module exactly
    as ``Trainer.fit`` does before the strategy's ``setup()`` runs the check.
    """
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or ElCheStrategy(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_flags,
    )
    trainer.strategy.connect(module)
    try:
        check_fit_configuration(trainer, trainer.strategy, trainer.strategy.settings)
    except MisconfigurationException as error:
        return error
    return None


SETUP_REFUSALS = [
    pytest.param({"model": "bn"}, {"sync_batchnorm": True}, "`sync_batchnorm=True`", id="sync_batchnorm"),
    pytest.param({"metric_sync_on_step": True}, {}, "dist_sync_on_step", id="metric_dist_sync_on_step"),
]


@pytest.mark.parametrize(("module_options", "trainer_flags", "needle"), SETUP_REFUSALS)
def test_setting_is_refused_before_training(module_options, trainer_flags, needle):
    error = fit_configuration_error(RefusalModule(**module_options), **trainer_flags)
    assert error is not None, f"{trainer_flags or module_options} was accepted"
    message = str(error)
    assert SETUP_HEADER in message, message
    assert needle in message, f"{needle!r} not named in {message!r}"


def test_micro_batches_are_refused_where_lightning_would_not_accumulate_them():
    error = fit_configuration_error(RefusalModule(manual=True), ElCheStrategy(micro_batch_sizes=[8, 4]))
    assert error is not None and "`micro_batch_sizes`" in str(error) and "manual optimization" in str(error)
    error = fit_configuration_error(RefusalModule(), ElCheStrategy(micro_batch_sizes=[8, 4]),
                                    callbacks=[GradientAccumulationScheduler({0: 2})])
    assert error is not None and "GradientAccumulationScheduler" in str(error)
    assert fit_configuration_error(RefusalModule(), ElCheStrategy(micro_batch_sizes=[8, 4]), accumulate_grad_batches=2) is None
    assert fit_configuration_error(RefusalModule(manual=True)) is None  # manual optimization alone is fine


@pytest.mark.parametrize(
    "trainer_flags",
    [
        {"val_check_interval": 5},
        {"val_check_interval": 5, "check_val_every_n_epoch": None},
        {"val_check_interval": 0.5},
        {"val_check_interval": "00:00:00:01"},
        {"limit_train_batches": 0.5},
        {"limit_train_batches": 10},
        {"overfit_batches": 2},
    ],
    ids=["val_check_interval_int", "check_val_every_n_epoch_none", "val_check_interval_float", "val_check_interval_time",
         "limit_train_batches_float", "limit_train_batches_int", "overfit_batches"],
)
def test_batch_and_time_counted_settings_are_accepted(trainer_flags):
    """Refused before 0.3: the cohort now decides them at boundaries (tests/test_loops.py runs each)."""
    assert fit_configuration_error(RefusalModule(), **trainer_flags) is None


def test_default_settings_are_accepted():
    """The refusals above come from the flags they set, not from a check that refuses everything
    (a BatchNorm network without ``sync_batchnorm`` is fine: ElChe averages its statistics)."""
    assert fit_configuration_error(RefusalModule(model="bn")) is None


@pytest.mark.timeout(120)
def test_dataloader_iter_is_refused_on_every_rank_without_hanging(tmp_path):
    """``training_step(dataloader_iter)`` is read off the module Lightning actually runs."""
    run = run_refused(tmp_path, training_step="dataloader_iter")
    assert_refused_on_every_rank(
        run, SETUP_HEADER, "`training_step(dataloader_iter)`", exception="MisconfigurationException"
    )


@pytest.mark.timeout(120)
def test_several_problems_are_listed_in_one_error(tmp_path):
    """Trainer flags and a module-level problem together: one error per rank, one bullet per problem."""
    run = run_refused(
        tmp_path, model="bn", metric_sync_on_step=True, training_step="dataloader_iter", trainer={"sync_batchnorm": True}
    )
    needles = ("`sync_batchnorm=True`", "`training_step(dataloader_iter)`", "dist_sync_on_step")
    assert_refused_on_every_rank(run, SETUP_HEADER, *needles, exception="MisconfigurationException")
    stderr = run["proc"].stderr
    for rank in range(WORLD):
        message = run["ranks"][rank]["exception_message"]
        assert message.count(SETUP_HEADER) == 1, message
        bullets = [line for line in message.splitlines() if line.startswith("  - ")]
        for needle in needles:
            assert sum(needle in b for b in bullets) == 1, f"{needle!r} is not exactly one bullet of {message!r}"
        # one raise per rank, not one per problem: the header appears once in each rank's traceback
        assert sum(line.startswith(f"[rank{rank}]:") and SETUP_HEADER in line for line in stderr.splitlines()) == 1


# --------------------------------------------------------------------------- refused in process_dataloader()
# Train DataLoaders ElChe cannot partition by index, refused when the train loader is set up.

SAMPLES, BATCH_SIZE = 64, 8


UNSPLITTABLE_LOADERS = [
    pytest.param(
        lambda: DataLoader(IterableIndexedDataset(SAMPLES), batch_size=BATCH_SIZE), "IterableDataset",
        id="iterable_dataset",
    ),
    pytest.param(  # a custom sampler Lightning did not wrap: use_distributed_sampler=False
        lambda: DataLoader(IndexedDataset(SAMPLES), batch_size=BATCH_SIZE, sampler=EveryOtherSampler(SAMPLES)),
        "DistributedSampler", id="custom_sampler_unwrapped",
    ),
    pytest.param(
        lambda: DataLoader(
            IndexedDataset(SAMPLES), batch_size=BATCH_SIZE, sampler=DistributedSampler(IndexedDataset(SAMPLES), 2, 0),
            num_workers=2, in_order=False,
        ),
        "`in_order=False`", id="out_of_order_workers",
    ),
]


@pytest.mark.parametrize(("make_loader", "needle"), UNSPLITTABLE_LOADERS)
def test_train_dataloader_that_cannot_be_split_is_refused(make_loader, needle):
    with pytest.raises(ValueError, match="ElCheStrategy") as refused:
        describe_train_loader(make_loader(), accumulate_grad_batches=1, seed=None)
    assert needle in str(refused.value), f"{needle!r} not named in {refused.value!r}"


def test_train_dataloader_with_distributed_sampler_is_accepted():
    """The loader Lightning builds from a plain ``shuffle=True`` DataLoader is what ElChe partitions."""
    dataset = IndexedDataset(SAMPLES)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=7)
    data, _ = describe_train_loader(
        DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler), accumulate_grad_batches=2, seed=None
    )
    assert (data.num_samples, data.seed, data.shuffle) == (SAMPLES, 7, True)
    assert (data.batch_size, data.samples_per_step) == (BATCH_SIZE, 2 * BATCH_SIZE)


def test_a_custom_sampler_is_the_epochs_order_drawn_alike_on_every_rank():
    """With ``use_distributed_sampler=True`` (the default) Lightning wraps a user's sampler in a
    ``DistributedSamplerWrapper``; ElChe trains the sampler's draw of each epoch, seeded per epoch, so
    every rank and a resumed run draw the same, and the sampler's own generator is left as it was."""
    dataset = IndexedDataset(SAMPLES)
    every_other = DistributedSamplerWrapper(EveryOtherSampler(SAMPLES), num_replicas=2, rank=0, seed=3)
    data, _ = describe_train_loader(DataLoader(dataset, batch_size=BATCH_SIZE, sampler=every_other), 1, None)
    assert (data.num_samples, data.seed) == (SAMPLES, 3)
    assert data.base_order(0).tolist() == list(range(0, SAMPLES, 2)) + list(range(1, SAMPLES, 2))
    mine = torch.Generator().manual_seed(11)
    weighted = WeightedRandomSampler(torch.ones(SAMPLES), num_samples=2 * SAMPLES, replacement=True, generator=mine)
    wrapped = DistributedSamplerWrapper(weighted, num_replicas=2, rank=0, seed=3)
    data, _ = describe_train_loader(DataLoader(dataset, batch_size=BATCH_SIZE, sampler=wrapped), 1, None)
    state = mine.get_state()
    first, again, other = data.base_order(0), TrainData(**{**data.__dict__}).base_order(0), data.base_order(1)
    assert len(first) == 2 * SAMPLES and torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(mine.get_state(), state) and weighted.generator is mine
    other_rank, _ = describe_train_loader(
        DataLoader(dataset, batch_size=BATCH_SIZE, sampler=DistributedSamplerWrapper(
            WeightedRandomSampler(torch.ones(SAMPLES), num_samples=2 * SAMPLES, replacement=True), 2, 1, seed=3)),
        1, None,
    )  # fmt: skip
    assert torch.equal(other_rank.base_order(0), first)  # another rank's sampler, with no generator: the same draw


def test_a_resume_refuses_a_sampler_that_draws_its_epoch_differently():
    def data_drawing(order: list[int]) -> TrainData:
        return TrainData(64, seed=0, shuffle=False, batch_size=8, samples_per_step=8, drop_last=False,
                         drawn=lambda epoch, seed: torch.tensor(order))

    point = ResumePoint(epoch=2, num_samples=64, covered=Spans.prefix(16), seed=0, world_size=2, cohort_steps_total=8,
                        logged_steps_total=8, controller={}, order_digest=data_drawing([3, 1, 2] * 21 + [0]).drawn_digest(2))
    point.check_fits(data_drawing([3, 1, 2] * 21 + [0]), "last.ckpt", warn=pytest.fail)  # drawn again alike
    with pytest.raises(ValueError, match="draws that epoch differently"):
        point.check_fits(data_drawing([1, 2, 3] * 21 + [0]), "last.ckpt", warn=pytest.fail)


DATA_REFUSALS = [
    pytest.param({"trainer": {"use_distributed_sampler": False}}, "DistributedSampler", id="use_distributed_sampler_false"),
    # Only rank 0 counts the one-shot shard (the shards without len() are split among the ranks):
    # rank 1 must raise the same error, not wait for rank 0 in the gather.
    pytest.param({"dataset": "shards", "one_shot_shard": True}, "is an iterator", id="one_shot_shard_on_one_rank"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "needle"), DATA_REFUSALS)
def test_train_dataloader_is_refused_on_every_rank_without_hanging(tmp_path, config, needle):
    """The loader ElChe refuses here is the one Lightning built on each rank, not one the test made."""
    run = run_refused(tmp_path, **config)
    assert_refused_on_every_rank(run, needle, exception="ValueError")


@pytest.mark.parametrize(
    ("sizes", "needle"),
    [
        ([8, 4, 4], "3 entries for 2 ranks"),
        ({2: 4}, "names rank(s) [2]"),
        ([8, 3], "must divide the train DataLoader's batch_size (8)"),
        ({1: 16}, "{1: 16} do not"),
    ],
)
def test_micro_batch_sizes_that_do_not_fit_the_fit_are_refused(sizes, needle):
    with pytest.raises(ValueError, match="`micro_batch_sizes`") as info:
        rank_batch_sizes(sizes, range(2), 8)
    assert needle in str(info.value)
    assert rank_batch_sizes({1: 2}, range(3), 8) == (8, 2, 8)
    assert rank_batch_sizes([8, 4], range(2), 8) == (8, 4)


class PositionalLoader(DataLoader):
    """A DataLoader subclass that takes its batch size positionally, as users write them."""

    def __init__(self, dataset, batch_size, **kwargs):
        super().__init__(dataset, batch_size, **kwargs)


class FixedBatchLoader(DataLoader):
    """A DataLoader subclass that sets its own batch size: it cannot be re-batched."""

    def __init__(self, dataset, **kwargs):
        kwargs.pop("batch_size", None)
        super().__init__(dataset, batch_size=8, **kwargs)


@pytest.mark.parametrize(
    "make",
    [lambda data: DataLoader(data, batch_size=8, shuffle=True), lambda data: PositionalLoader(data, 8, shuffle=True)],
    ids=["DataLoader", "positional subclass"],
)
def test_a_rank_loader_is_remade_with_its_micro_batch(make):
    dataset = IndexedDataset(64, seed=0)
    user = _lightning_wrapped(lambda: make(dataset))
    data = TrainData(64, seed=0, shuffle=True, batch_size=8, samples_per_step=8, drop_last=False)
    sampler = list(range(64))
    loader = with_sampler(user, data, sampler, 4)
    assert type(loader) is type(user) and loader.batch_size == 4
    assert [int(i) for batch in loader for i in batch[2]] == sampler
    assert _update_dataloader(user, sampler).batch_size == 8  # the user's loader itself is unchanged


def test_a_loader_that_sets_its_own_batch_size_is_refused_with_micro_batches():
    user = _lightning_wrapped(lambda: FixedBatchLoader(IndexedDataset(64, seed=0), shuffle=True))
    data = TrainData(64, seed=0, shuffle=True, batch_size=8, samples_per_step=8, drop_last=False)
    with pytest.raises(ValueError, match="micro_batch_sizes") as info:
        with_sampler(user, data, list(range(64)), 4)
    assert "FixedBatchLoader" in str(info.value)


def _lightning_wrapped(make_loader):
    """A loader built as Lightning builds the user's (its init arguments recorded for re-instantiation)."""
    with _replace_dunder_methods(DataLoader, "dataset"):
        return make_loader()
