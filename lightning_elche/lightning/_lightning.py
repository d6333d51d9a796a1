"""Every private Lightning name ElChe touches, in one place.

Lightning has no public hooks for these, so each access is a named function here and
``tests/test_lightning_internals.py`` fails loudly when a Lightning release moves one of them.
Why each patch is needed: its function's docstring, and docs/architecture.md.
"""

from __future__ import annotations

import csv
import time
from types import FrameType
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union, cast

import lightning.pytorch as pl
from lightning.fabric.utilities import rank_zero as rank_zero_module
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter as CSVExperimentWriter
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

SubprocessScriptLauncher = subprocess_script._SubprocessScriptLauncher  # the warm launcher's base (warm_launch.py)
HYDRA_AVAILABLE = subprocess_script._HYDRA_AVAILABLE  # and how it words a rank's command, as Lightning does
basic_subprocess_command = subprocess_script._basic_subprocess_cmd
hydra_subprocess_command = subprocess_script._hydra_subprocess_cmd
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
SIGTERM_NOTIFIER = "_sigterm_notifier_fn"
REQUEUE_HANDLER = "_slurm_sigusr_handler_fn"
PATCHED_CLASS_ATTRIBUTES = (
    (_TrainingEpochLoop, SIGTERM_BROADCAST),
    (_SignalConnector, SIGTERM_NOTIFIER),
    (_SignalConnector, REQUEUE_HANDLER),
)


class ConnectorAttributes(Protocol):
    """The Trainer's attributes that its connectors set from outside the class (``trainer/setup.py``,
    ``callback_connector.py``), which Lightning's type for the Trainer therefore does not declare."""

    callbacks: list[pl.Callback]
    fast_dev_run: Union[int, bool]
    log_every_n_steps: int
    _val_check_time_interval: Optional[float]
    _last_val_time: float


def connector_attributes(trainer: "pl.Trainer") -> ConnectorAttributes:
    """``trainer``, typed with the attributes its connectors set (:class:`ConnectorAttributes`)."""
    return cast(ConnectorAttributes, trainer)


def _no_per_batch_broadcast() -> None:
    """Stands in for Lightning's per-batch SIGTERM broadcast; SIGTERM rides the boundary instead."""


def install_sigterm_patches(
    trainer: "pl.Trainer", on_sigterm: Callable[[int], None], on_requeue: Callable[[int], None]
) -> None:
    """Replace the signal handling Lightning does outside boundaries.

    The per-batch broadcast (Lightning >= 2.5.2) deadlocks as soon as ranks run different batch
    counts, and the signal handler's own broadcast blocks the rank that got the signal. The
    replacement handler keeps Lightning's forwarding of the signal to launched children and
    only records it; the next boundary tells every rank at once. SLURM's requeue signal
    (SIGUSR1 with auto-requeue) saves a checkpoint from the handler, mid-window and on each rank
    at its own moment; it is recorded too, and the boundary runs Lightning's handler on every rank.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, SIGTERM_BROADCAST):
        setattr(epoch_loop, SIGTERM_BROADCAST, _no_per_batch_broadcast)
    connector = trainer._signal_connector

    def notifier(signum: int, frame: FrameType | None) -> None:
        launcher = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        on_sigterm(signum)

    setattr(connector, SIGTERM_NOTIFIER, notifier)
    setattr(connector, REQUEUE_HANDLER, lambda signum, frame: on_requeue(signum))


def requeue_now(trainer: "pl.Trainer", signum: int) -> None:
    """Lightning's SLURM requeue handler (hpc checkpoint on every rank, ``scontrol requeue`` on rank 0)."""
    # the handler ignores its frame, annotated FrameType although a signal handler may get None
    _SignalConnector._slurm_sigusr_handler_fn(trainer._signal_connector, signum, None)  # type: ignore[arg-type]


def remove_sigterm_patches(trainer: "pl.Trainer") -> None:
    for owner in (trainer.fit_loop.epoch_loop, trainer._signal_connector):
        for _, name in PATCHED_CLASS_ATTRIBUTES:
            owner.__dict__.pop(name, None)


def raise_sigterm_at_batch_end(trainer: "pl.Trainer") -> None:
    """Makes Lightning raise SIGTERMException at the end of the current batch on this rank."""
    trainer._signal_connector.received_sigterm = True


def preemption_checkpoint_path(trainer: "pl.Trainer") -> str:
    """The next ``hpc_ckpt_N.ckpt`` in ``default_root_dir``: what Lightning resumes from after a SLURM
    requeue, and what ``fit(ckpt_path="hpc")`` finds elsewhere."""
    return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)


def set_global_step(trainer: "pl.Trainer", step: int) -> None:
    """Overwrite the optimizer-step counter behind ``trainer.global_step`` (automatic and manual)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    manual = epoch_loop.manual_optimization.optim_step_progress.total
    for progress in (automatic, manual):
        progress.ready = step
        progress.completed = step


def set_logged_step(trainer: "pl.Trainer", step: int) -> None:
    """Overwrite the loggers' step axis (Lightning's count of batches that stepped an optimizer)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def logged_step(trainer: "pl.Trainer") -> int:
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def take_over_max_steps(trainer: "pl.Trainer") -> int:
    """Disable Lightning's per-rank ``max_steps`` check and return the user's value."""
    epoch_loop = trainer.fit_loop.epoch_loop
    max_steps = epoch_loop.max_steps
    epoch_loop.max_steps = -1
    return max_steps


def restore_max_steps(trainer: "pl.Trainer", max_steps: int) -> None:
    trainer.fit_loop.epoch_loop.max_steps = max_steps


def discard_train_dataloader(trainer: "pl.Trainer") -> None:
    """Forget a train loader set up early (for ``estimated_stepping_batches``) with DDP's sampler.

    The fit loop then sets it up again when training starts, with ElChe's sampler and no length.
    """
    fit_loop = trainer.fit_loop
    if fit_loop._combined_loader is None:
        return
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()
        fit_loop._data_fetcher = None
    fit_loop._combined_loader = None


def is_last_batch(trainer: "pl.Trainer") -> bool:
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def not_the_last_batch(trainer: "pl.Trainer") -> None:
    """Keep Lightning from running the epoch-end validation after this batch."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False


def restart_train_iterator(trainer: "pl.Trainer") -> None:
    """Start the current epoch's train iterator again (the sampler then serves what is left of the
    epoch); batches fetched ahead are dropped, and the epoch ends only when the new iterator does."""
    fetcher = trainer.fit_loop._data_fetcher
    assert fetcher is not None
    iter(fetcher)
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done


def in_validation_step(trainer: "pl.Trainer") -> bool:
    """Whether the trainer is between a validation loop's first step and its epoch end (what Lightning's own
    logger connector takes for "on step")."""
    validating = trainer.validating or trainer.sanity_checking
    return validating and trainer._logger_connector._first_loop_iter is not None


def forget_val_dataloaders(trainer: "pl.Trainer") -> None:
    """Have validation set its loaders up again (their DistributedSampler splits for this world size)."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def dump_checkpoint(trainer: "pl.Trainer", weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write now, in memory (a collective: every rank calls it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=weights_only)


def restore_modules_and_callbacks(trainer: "pl.Trainer", checkpoint: dict[str, Any]) -> None:
    """Load a checkpoint held in memory as ``Trainer.fit(ckpt_path=...)`` loads a file: the weights and the
    callbacks' states now, the loops, optimizers and schedulers when Lightning restores the training state
    right after the strategy's ``setup``. No sanity check: the fit is resumed, not started."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    connector.restore_model()
    connector.restore_datamodule()
    connector.restore_callbacks()
    trainer.num_sanity_val_steps = 0


def logger_versions(trainer: "pl.Trainer") -> list[Any]:
    """Each logger's run as rank 0 resolved it, for the other ranks to continue (:func:`pin_logger_versions`):
    TensorBoard's and CSV's version folder (any logger keeping a ``_version``), W&B's and MLflow's run id
    (their run starts here if it has not yet: a W&B run has no id before ``wandb.init``); None for a
    logger whose run ElChe cannot carry over (a warning on rank 0 names it). Rank 0's are the ones that count:
    elsewhere no run is started and a W&B or MLflow logger has no id yet."""
    versions: list[Any] = []
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            _ = logger.experiment
        if isinstance(logger, (WandbLogger, MLFlowLogger)) or hasattr(logger, "_version"):
            versions.append(logger.version)
            continue
        if logger.version is not None:
            rank_zero_warn(
                f"ElChe: the run of {type(logger).__name__} (version {logger.version!r}) cannot be carried to the "
                "other ranks: if rank 0 is lost in this elastic fit, the rank that takes its place starts another "
                "run. Give the logger its run id or version explicitly, the same on every rank, to keep one run.",
                category=RuntimeWarning,
            )
        versions.append(None)
    return versions


def pin_logger_versions(trainer: "pl.Trainer", versions: list[Any]) -> None:
    """Make every logger continue the run rank 0 resolved, so that a rank that becomes rank 0 later (an
    elastic cohort's new leader) writes on in it instead of starting another: the version folder of
    TensorBoard and CSV, W&B's run id (its ``wandb.init`` then resumes the run) and MLflow's.

    Lightning's CSV writer deletes the ``metrics.csv`` it finds in its folder, the previous rank 0's: on
    the other ranks the CSV logger gets a writer that appends to it instead (:class:`ContinuingCSVWriter`).
    """
    for logger, version in zip(trainer.loggers, versions):
        if version is None:
            continue
        if isinstance(logger, WandbLogger):
            logger._id = logger._wandb_init["id"] = version
        elif isinstance(logger, MLFlowLogger):
            logger._run_id = version
        elif hasattr(logger, "_version"):
            logger._version = version
            if isinstance(logger, CSVLogger) and trainer.global_rank != 0 and logger._experiment is None:
                logger._experiment = ContinuingCSVWriter(logger.log_dir)


class ContinuingCSVWriter(CSVExperimentWriter):
    """CSVLogger's writer for a rank that may become rank 0: it keeps the ``metrics.csv`` the rank 0
    before it wrote and appends its rows, under a header that keeps every column already there."""

    @override
    def _check_log_dir_exists(self) -> None:
        """Lightning's warns and deletes an existing ``metrics.csv``: here it is the run so far."""

    @override
    def save(self) -> None:
        if not self.metrics_keys and self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])
        super().save()


def module_trainer(module: "pl.LightningModule") -> Optional["pl.Trainer"]:
    """The module's trainer, or None before it is attached (``module.trainer`` raises then)."""
    return module._trainer


def step_timers(trainer: "pl.Trainer") -> list[tuple[Timer, float]]:
    """``Trainer(max_time=...)``'s Timers that check after every step, with their durations in seconds."""
    return [
        (timer, float(timer._duration))
        for timer in connector_attributes(trainer).callbacks
        if isinstance(timer, Timer) and timer._duration is not None and timer._interval == "step"
    ]


def set_timer_interval(timer: Timer, interval: str) -> None:
    """When a Timer checks its duration: "step" (after every batch, per rank) or "epoch"."""
    timer._interval = interval


def step_checkpoint_interval(checkpoint: ModelCheckpoint) -> int:
    """``ModelCheckpoint(every_n_train_steps=N)``'s N (0: not a step checkpoint)."""
    return int(checkpoint._every_n_train_steps)


def set_step_checkpoint_interval(checkpoint: ModelCheckpoint, every_n: int) -> None:
    """Open (1), close (0) or restore (N) a ModelCheckpoint's per-step check."""
    checkpoint._every_n_train_steps = every_n


def train_time_interval(checkpoint: ModelCheckpoint) -> Optional[Any]:
    """``ModelCheckpoint(train_time_interval=...)`` (a timedelta), or None."""
    return checkpoint._train_time_interval


def set_train_time_interval(checkpoint: ModelCheckpoint, interval: Optional[Any]) -> None:
    """Take a time checkpoint's per-batch clock check over (None) or give it back: the check broadcasts
    rank 0's decision after every batch, which deadlocks as soon as ranks run different batch counts."""
    checkpoint._train_time_interval = interval


VALIDATION_CHECK = "_should_check_val_fx"
# An int ``val_check_interval`` other than 1: what Lightning's ``fit_loop.setup_data`` accepts for a train
# sampler without a length (a fraction of an epoch raises there) while every other reader of the setting
# (ModelCheckpoint and EarlyStopping: "validation is not once per epoch") sees what a fraction tells it.
BATCH_VALIDATION_STANDIN = 2


def decide_validation(trainer: "pl.Trainer", due: Callable[[], bool]) -> None:
    """Lightning's per-rank decision to validate after a batch (``_TrainingEpochLoop._should_check_val_fx``:
    a batch count or rank 0's clock, which ranks with different batch counts cannot share) replaced by
    ``due()``, the cohort's decision at this batch's boundary, within Lightning's own conditions: the
    epoch validates at all (``check_val_every_n_epoch``), or a stop request may end the fit here."""
    epoch_loop = trainer.fit_loop.epoch_loop

    def should_check_val(data_fetcher: Any) -> bool:
        decided = due()  # taken after every batch: a decision the epoch's gate drops is not carried to a later batch
        stopping = trainer.should_stop and trainer.fit_loop._can_stop_early
        return epoch_loop._should_check_val_epoch() and (decided or stopping)

    setattr(epoch_loop, VALIDATION_CHECK, should_check_val)


def restore_validation_decision(trainer: "pl.Trainer") -> None:
    """Lightning's own per-batch validation decision again."""
    vars(trainer.fit_loop.epoch_loop).pop(VALIDATION_CHECK, None)


def seconds_since_validation(trainer: "pl.Trainer") -> float:
    """This rank's seconds since its last validation ended (or training started): what a time-based
    ``val_check_interval`` is measured by (``trainer._last_val_time``, set by Lightning)."""
    return time.monotonic() - connector_attributes(trainer)._last_val_time


def val_check_time_interval(trainer: "pl.Trainer") -> Optional[float]:
    """Lightning 2.6's time-based ``val_check_interval`` in seconds, or None."""
    return connector_attributes(trainer)._val_check_time_interval


def layer_sync(strategy: "pl.strategies.ParallelStrategy") -> Optional[Any]:
    """``sync_batchnorm=True``'s layer sync plugin, or None."""
    return strategy._layer_sync


def streaming_chunk_intervals(dataset: Any) -> list[Any]:
    """A LitData StreamingDataset's chunk intervals (each with ``roi_start_idx``, ``roi_end_idx``), read
    through a cache of its own: the dataset's cache object is left unset, since DataLoader workers each
    create theirs on first read."""
    from litdata.utilities.env import _WorkerEnv

    return list(dataset._create_cache(worker_env=_WorkerEnv.detect()).get_chunk_intervals())


def combined_streaming_parts(dataset: Any) -> tuple[list[Any], int, Optional[list[float]], str]:
    """A LitData CombinedStreamingDataset's datasets, seed, weights (None: ``iterate_over_all``, every item
    once) and ``batching_method``."""
    weights = None if dataset._iterate_over_all else [float(w) for w in dataset._weights]
    return list(dataset._datasets), int(dataset._seed), weights, str(dataset._batching_method)


class ParallelStreamingParts(NamedTuple):
    """What a LitData ParallelStreamingDataset zips and how (its constructor's arguments)."""

    datasets: list[Any]
    length: Optional[float]  # None: the shortest dataset's; an int: cycled to it; inf: endless
    seed: int
    resume: bool  # cycling: the stream goes on across epochs (else it starts again each epoch)
    reset_rngs: bool  # the transform's generators start again each epoch
    transform: Optional[Callable[..., Any]]
    transform_takes_generators: bool  # transform(samples, rngs), else transform(samples)


def parallel_streaming_parts(dataset: Any) -> ParallelStreamingParts:
    """A LitData ParallelStreamingDataset's settings."""
    return ParallelStreamingParts(
        list(dataset._datasets), dataset._length, int(dataset._seed), bool(dataset.resume), bool(dataset._reset_rngs),
        dataset._transform, dataset._transform_nargs == 2,
    )  # fmt: skip


def wrapped_sampler(sampler: object) -> Optional[tuple[Any, int]]:
    """The user's custom train sampler inside the ``DistributedSamplerWrapper`` Lightning put around it
    for DDP, with the wrapper's seed (None for any other sampler)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper, _DatasetSamplerWrapper

    if not isinstance(sampler, DistributedSamplerWrapper):
        return None
    assert isinstance(sampler.dataset, _DatasetSamplerWrapper)
    return sampler.dataset._sampler, sampler.seed


def set_rank_zero(rank: int) -> None:
    """Lightning's rank-zero-only flag (logging, progress bars, warnings), kept in two modules."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]  # set on the function


def read_rank_zero_again() -> None:
    """Lightning reads a process's rank into ``rank_zero_only.rank`` once, as it is imported: a rank
    forked from a process that had imported it (``warm_start.py``) reads its own environment again."""
    rank_zero_module.rank_zero_only.rank = rank_zero_module._get_rank() or 0  # type: ignore[attr-defined]  # set by Lightning, not in its stubs


def private_names() -> dict[str, Any]:
    """The objects the helpers above rely on, for the release-compatibility test."""
    return {
        "_TrainingEpochLoop._broadcast_sigterm_tensor": getattr(_TrainingEpochLoop, SIGTERM_BROADCAST, None),
        "_SignalConnector._sigterm_notifier_fn": getattr(_SignalConnector, SIGTERM_NOTIFIER, None),
        "_SignalConnector._slurm_sigusr_handler_fn": getattr(_SignalConnector, REQUEUE_HANDLER, None),
        "_CheckpointConnector.hpc_save_path": getattr(_CheckpointConnector, "hpc_save_path", None),
        **{  # step- and time-based validation are decided by the cohort (decide_validation)
            f"_TrainingEpochLoop.{name}": getattr(_TrainingEpochLoop, name, None)
            for name in (VALIDATION_CHECK, "_should_check_val_epoch")
        },
        **{  # the warm launcher (warm_launch.py) is Lightning's, its rank commands too
            "_SubprocessScriptLauncher._call_children_scripts": getattr(SubprocessScriptLauncher, "_call_children_scripts", None),
            "_SubprocessScriptLauncher._check_can_spawn_children": getattr(SubprocessScriptLauncher, "_check_can_spawn_children", None),
            "_basic_subprocess_cmd": basic_subprocess_command, "_hydra_subprocess_cmd": hydra_subprocess_command,
            "lightning.fabric.utilities.rank_zero._get_rank": getattr(rank_zero_module, "_get_rank", None),
        },
        **{  # an elastic fit's joiner restores a checkpoint held in memory
            f"_CheckpointConnector.{name}": getattr(_CheckpointConnector, name, None)
            for name in ("dump_checkpoint", "restore_model", "restore_datamodule", "restore_callbacks")
        },
    }
