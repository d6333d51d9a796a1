"""Every private Lightning name ElChe relies on still exists where we reach for it.

When a Lightning release moves one of these, this file fails naming the attribute, instead of
ElChe silently deadlocking or mis-counting steps (see lightning_elche/lightning/_lightning.py and
lightning_elche/compatibility.py).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import lightning
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from packaging.version import Version

from lightning_elche.lightning import _lightning

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parent.parent

_MISSING = object()


def resolve(root: object, dotted: str, root_name: str) -> object:
    """Follow ``dotted`` from ``root``; fail naming the first attribute that is not there."""
    obj = root
    walked = root_name
    for part in dotted.split("."):
        value = getattr(obj, part, _MISSING)
        if value is _MISSING:
            pytest.fail(
                f"Lightning {lightning.__version__}: `{walked}` has no attribute `{part}` "
                f"(ElChe needs `{root_name}.{dotted}`)"
            )
        obj, walked = value, f"{walked}.{part}"
    return obj


def make_trainer(**kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.fixture
def trainer() -> Trainer:
    return make_trainer()


def test_private_names_all_resolve():
    names = _lightning.private_names()
    assert names, "private_names() is empty"
    missing = [name for name, value in names.items() if value is None]
    assert not missing, f"Lightning {lightning.__version__} no longer has: {', '.join(missing)}"
    for name, value in names.items():
        assert callable(value), f"{name} is not callable"


def test_patched_class_attributes_exist():
    for owner, name in _lightning.PATCHED_CLASS_ATTRIBUTES:
        assert callable(getattr(owner, name, None)), f"`{owner.__name__}.{name}` is missing"
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None)), (
        "`_TrainingEpochLoop._broadcast_sigterm_tensor` is missing"
    )
    assert callable(getattr(_SignalConnector, "_sigterm_notifier_fn", None)), (
        "`_SignalConnector._sigterm_notifier_fn` is missing"
    )


def test_signal_connector_received_sigterm_is_an_instance_attribute(trainer):
    connector = resolve(trainer, "_signal_connector", "trainer")
    assert isinstance(connector, _SignalConnector)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        connector.register_signal_handlers()
        assert "received_sigterm" in vars(connector), "`_SignalConnector.received_sigterm` is not set by register"
        assert connector.received_sigterm is False
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(
    "path",
    [
        "epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed",
        "epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.ready",
        "epoch_loop.manual_optimization.optim_step_progress.total.completed",
        "epoch_loop.manual_optimization.optim_step_progress.total.ready",
        "epoch_loop.max_steps",
        "epoch_loop._batches_that_stepped",
        "epoch_loop.batch_progress.is_last_batch",
        "epoch_progress.current.processed",
        "min_steps",
        "_combined_loader",
        "_data_fetcher",
        "_can_stop_early",  # the patched validation decision keeps Lightning's "validate before stopping"
    ],
)
def test_fit_loop_paths_exist(trainer, path):
    resolve(trainer.fit_loop, path, "trainer.fit_loop")


def test_trainer_private_attributes(trainer):
    assert resolve(trainer, "_val_check_time_interval", "trainer") is None
    timed = make_trainer(val_check_interval="00:00:00:30")
    assert resolve(timed, "_val_check_time_interval", "trainer") == 30
    resolve(trainer, "_signal_connector", "trainer")


def test_validation_decision_is_an_epoch_loop_method_and_the_time_interval_starts_at_setup_data():
    """``decide_validation`` shadows ``_should_check_val_fx`` on the loop instance; a time-based
    ``val_check_interval`` is measured from ``trainer._last_val_time``, which ``fit_loop.setup_data`` sets."""
    import inspect

    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert list(inspect.signature(_TrainingEpochLoop._should_check_val_fx).parameters) == ["self", "data_fetcher"]
    assert "trainer._last_val_time = " in inspect.getsource(_FitLoop.setup_data)


def test_model_checkpoint_private_attributes():
    default = ModelCheckpoint()
    assert resolve(default, "_every_n_train_steps", "ModelCheckpoint()") == 0
    assert resolve(default, "_train_time_interval", "ModelCheckpoint()") is None
    stepped = ModelCheckpoint(every_n_train_steps=5)
    assert stepped._every_n_train_steps == 5


def test_callback_and_progress_bar_metrics_are_the_connectors_own_dicts(trainer):
    """ElChe's boundary series go into ``trainer.callback_metrics`` (what ModelCheckpoint and EarlyStopping
    monitor) and its anchor and share into ``trainer.progress_bar_metrics`` by updating the dicts the
    properties return: they must be the logger connector's own, not copies."""
    trainer.callback_metrics.update({"elche/anchor": 4.0})
    trainer.progress_bar_metrics.update({"elche_anchor": 4.0})
    assert trainer.callback_metrics["elche/anchor"] == 4.0
    assert trainer.progress_bar_metrics["elche_anchor"] == 4.0
    assert resolve(trainer, "log_every_n_steps", "trainer") == 50  # set by the logger connector


def test_logger_run_attributes(tmp_path, monkeypatch):
    """What pin_logger_versions sets to make a logger continue rank 0's run, and CSV's writer's parts."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    for logger in (TensorBoardLogger(tmp_path), CSVLogger(tmp_path)):
        resolve(logger, "_version", type(logger).__name__)
    assert resolve(CSVLogger(tmp_path), "_experiment", "CSVLogger()") is None
    for name in ("_check_log_dir_exists", "save", "metrics_keys", "metrics_file_path", "_fs"):
        resolve(ExperimentWriter(str(tmp_path / "csv")), name, "csv_logs.ExperimentWriter()")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # restored after the test (WandbLogger sets it for offline runs)
    wandb_logger = WandbLogger(offline=True, save_dir=str(tmp_path), id="run-a")
    assert resolve(wandb_logger, "_id", "WandbLogger()") == "run-a"
    assert resolve(wandb_logger, "_wandb_init", "WandbLogger()")["id"] == "run-a"
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store on request only
    mlflow_logger = MLFlowLogger(tracking_uri=(tmp_path / "mlruns").as_uri(), run_id="abc")
    assert resolve(mlflow_logger, "_run_id", "MLFlowLogger()") == "abc"


def test_timer_private_interval():
    assert resolve(Timer(duration="00:00:01:00", interval="step"), "_interval", "Timer()") == "step"
    assert resolve(Timer(duration="00:00:01:00", interval="epoch"), "_interval", "Timer()") == "epoch"
    assert resolve(Timer(duration="00:00:01:00"), "_duration", "Timer()") == 60


def test_ddp_layer_sync():
    assert resolve(DDPStrategy(), "_layer_sync", "DDPStrategy()") is None
    synced = make_trainer(strategy=DDPStrategy(), sync_batchnorm=True).strategy
    assert resolve(synced, "_layer_sync", "DDPStrategy()") is not None


# ------------------------------------------------------------------------ the helpers themselves


def test_set_global_step_moves_trainer_global_step(trainer):
    assert trainer.global_step == 0
    _lightning.set_global_step(trainer, 17)
    assert trainer.global_step == 17
    loop = trainer.fit_loop.epoch_loop
    assert loop.manual_optimization.optim_step_progress.total.completed == 17
    assert loop.automatic_optimization.optim_progress.optimizer.step.total.ready == 17


def test_set_logged_step_moves_the_loggers_step(trainer):
    _lightning.set_logged_step(trainer, 41)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 41
    assert trainer.fit_loop.epoch_loop.on_save_checkpoint()["_batches_that_stepped"] == 41  # what checkpoints store


def test_max_steps_take_over_and_restore():
    trainer = make_trainer(max_steps=25)
    assert trainer.max_steps == 25
    assert _lightning.take_over_max_steps(trainer) == 25
    assert trainer.fit_loop.epoch_loop.max_steps == -1
    _lightning.restore_max_steps(trainer, 25)
    assert trainer.max_steps == 25


def test_is_last_batch(trainer):
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.is_last_batch = False
    assert _lightning.is_last_batch(trainer) is False
    progress.is_last_batch = True
    assert _lightning.is_last_batch(trainer) is True


def test_sigterm_patches_install_and_remove(trainer):
    epoch_loop = trainer.fit_loop.epoch_loop
    connector = trainer._signal_connector
    seen, requeues = [], []
    _lightning.install_sigterm_patches(trainer, seen.append, requeues.append)
    assert "_broadcast_sigterm_tensor" in vars(epoch_loop)
    epoch_loop._broadcast_sigterm_tensor()  # the stand-in issues no collective
    assert "_sigterm_notifier_fn" in vars(connector)
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert seen == [signal.SIGTERM]
    assert connector.received_sigterm is False  # only recorded; the boundary raises it
    _lightning.raise_sigterm_at_batch_end(trainer)
    assert connector.received_sigterm is True
    connector._slurm_sigusr_handler_fn(signal.SIGUSR1, None)  # SLURM's requeue signal: recorded, nothing saved
    assert requeues == [signal.SIGUSR1]
    _lightning.remove_sigterm_patches(trainer)
    assert "_broadcast_sigterm_tensor" not in vars(epoch_loop)
    assert "_sigterm_notifier_fn" not in vars(connector)
    assert "_slurm_sigusr_handler_fn" not in vars(connector)
    assert epoch_loop._broadcast_sigterm_tensor.__func__ is _TrainingEpochLoop._broadcast_sigterm_tensor
    assert connector._sigterm_notifier_fn.__func__ is _SignalConnector._sigterm_notifier_fn


def test_installed_lightning_within_declared_range():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = [d for d in pyproject["project"]["dependencies"] if re.match(r"lightning\s*[<>=!~]", d)]
    assert len(declared) == 1, f"expected one `lightning` requirement in pyproject.toml, found {declared}"
    match = re.fullmatch(r"lightning\s*>=\s*([\w.]+)\s*,\s*<\s*([\w.]+)", declared[0].replace(" ", ""))
    assert match, f"cannot parse `{declared[0]}` as lightning>=X,<Y"
    low, high = Version(match.group(1)), Version(match.group(2))
    installed = Version(lightning.__version__)
    assert low <= installed < high, f"lightning {installed} is outside the declared range [{low}, {high})"
