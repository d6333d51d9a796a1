"""The controller callback: Lightning's hooks in, the cohort core's decisions applied to the trainer.

Lightning gives a strategy no after-batch hook, so boundaries run here, in
``on_train_batch_end`` of a callback that the strategy puts first in ``trainer.callbacks``: after
the optimizer step and the step-interval schedulers, before any other callback (ModelCheckpoint
is moved last by Lightning) and before the validation check of the same batch, so validation
and checkpoints always see the consensus. The callback holds no cohort state: it reads
:class:`~lightning_elche.cohort.core.Cohort` (``strategy.cohort``) and applies its outcomes.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Optional, Protocol

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.records import Outcome
from lightning_elche.comm.liveness import CohortFailure
from lightning_elche.lightning import _lightning, telemetry
from lightning_elche.lightning.checkpoints import STATE_KEY, CohortCheckpoints
from lightning_elche.lightning.progress import keep_total_ahead, show_progress
from lightning_elche.lightning.session import FitSession
from lightning_elche.lightning.validation import ValidationSplit
from lightning_elche.lightning.world import World


class BoundaryHost(Protocol):
    """What the callback needs of :class:`~lightning_elche.ElCheStrategy` (typed here, so the two
    modules do not import each other): the fit in progress, the membership mode, the checkpoints."""

    @property
    def session(self) -> Optional[FitSession]: ...

    @property
    def world(self) -> World: ...

    @property
    def checkpoints(self) -> CohortCheckpoints: ...


class ElCheCallback(pl.Callback):
    """Runs ElChe boundaries; added automatically by :class:`~lightning_elche.ElCheStrategy`."""

    def __init__(self, strategy: BoundaryHost) -> None:
        self.strategy = strategy
        self._fit_started = time.perf_counter()

    @property
    def session(self) -> FitSession:
        session = self.strategy.session
        if session is None:
            raise RuntimeError("ElChe has no cohort: the fit was not set up by ElCheStrategy")
        return session

    @property
    def cohort(self) -> Cohort:
        return self.session.cohort

    # ------------------------------------------------------------------ checkpoint state

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.strategy.checkpoints.state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.checkpoints.load_state(state_dict)

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_started = time.perf_counter()
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(telemetry.CUSTOM_SCALARS_LAYOUT)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        rank_zero_info(telemetry.summary(self.cohort.history, time.perf_counter() - self._fit_started))
        if self.cohort.requests.sigterm:
            # No boundary is left to tell the other ranks, and stopping this rank alone would leave them
            # waiting in the final validation's collectives; training is complete, so the fit finishes.
            warnings.warn(
                f"ElChe: rank {trainer.global_rank} received SIGTERM after the fit's last boundary, with training "
                "already complete: the fit finished as usual (final validation, end-of-fit checkpoints) instead of "
                "stopping, and no preemption checkpoint was written. The scheduler's grace period (SLURM's KillWait) "
                "must cover the final validation for those to complete.",
                RuntimeWarning,
                stacklevel=2,
            )

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.cohort.start_clock(time.perf_counter())  # validation and epoch start-up are not training time
        self._hold_stop_request(trainer)  # e.g. EarlyStopping's, carried over while min_steps is unmet

    def _hold_stop_request(self, trainer: "pl.Trainer") -> None:
        """Keep ``trainer.should_stop`` from acting mid-window; the next boundary decides for all ranks.

        Lightning ends a rank's epoch after any batch in which ``should_stop`` is set, which on
        uneven ranks would leave the others waiting at the next boundary.
        """
        if trainer.should_stop:
            self.cohort.requests.request_stop()
            trainer.should_stop = False

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        if self.strategy.world.training_starts(trainer):  # a rank that joined an elastic fit mid-epoch: its clock starts
            self.cohort.start_clock(time.perf_counter())
        logged_step, schedule_step = self.cohort.batch_started()
        _lightning.set_logged_step(trainer, logged_step)
        if schedule_step is not None:
            self.session.takeover.follow_schedules(schedule_step)
        if batch_idx == 0:  # after the bar's own epoch start, which leaves its total unknown
            show_progress(trainer, self.cohort, 0, last_batch=False)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.cohort.epoch_ended()

    def _timed_validation(self, trainer: "pl.Trainer") -> Optional[ValidationSplit]:
        """The fit's validation split, whose speed a validation is timed for (not a sanity check's; none outside a fit)."""
        session = self.strategy.session
        return None if session is None or trainer.sanity_checking else session.validation

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if (split := self._timed_validation(trainer)) is not None:
            split.clock_started()

    @override
    def on_validation_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if (split := self._timed_validation(trainer)) is not None:
            split.batch_started()

    @override
    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if (split := self._timed_validation(trainer)) is not None:
            split.clock_stopped()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._hold_stop_request(trainer)
        self.session.takeover.close_checkpoints()  # unless this batch's boundary opens them
        last_batch = _lightning.is_last_batch(trainer)
        if self.cohort.batch_ended(time.perf_counter(), last_batch, self.session.peek_claims()):
            self._boundary(trainer, self.cohort)
            while self.cohort.boundary_due():  # dynamic dispatch: this rank's epoch ended, windows remain open
                self._boundary(trainer, self.cohort)
            self.cohort.start_clock(time.perf_counter())  # a new cohort after an elastic membership change
            show_progress(trainer, self.cohort, batch_idx + 1, last_batch)
        elif not last_batch:
            keep_total_ahead(trainer.progress_bar_callback, batch_idx + 1)

    # ------------------------------------------------------------------ the boundary

    def _boundary(self, trainer: "pl.Trainer", cohort: Cohort) -> None:
        """This rank's report -> the exchange (comm) -> the cohort's decision -> applied to the trainer."""
        session, world = self.session, self.strategy.world
        started = time.perf_counter()
        takeover = session.takeover
        report = cohort.local_report(
            train_s=takeover.train_s(), user_values=self._user_values(trainer), lr=_learning_rate(trainer),
            clock_due=takeover.clock_due(), validation_ms=session.validation.local_ms,
        )
        world.before_exchange(session, report)
        if session.liveness is not None:
            session.liveness.reached(len(cohort.history))
        try:
            result = world.exchange(
                session, report, lambda control: cohort.needs_consensus(control) or world.needs_consensus(control)
            )
        except CohortFailure as failure:
            if not world.continues_without(failure, cohort.world_size):
                raise
            world.continue_without(session, failure.lost, report, self.strategy.checkpoints)  # an elastic fit goes on
            return
        session.validation.observe(result.control.per_rank["validation_ms"])
        outcome = cohort.boundary(result.control, result.divergence, result.averaged, level=result.level)
        session.takeover.follow_schedules(outcome.cohort_step)
        self._apply(trainer, outcome)
        cohort.close_boundary((time.perf_counter() - started) * 1000.0)
        telemetry.publish(trainer, cohort, outcome, result.sent_bytes)  # to the callbacks on every rank, the loggers
        if not outcome.stops:
            world.after_boundary(session, result.control, self.strategy.checkpoints)  # joiners come in here

    def _apply(self, trainer: "pl.Trainer", outcome: Outcome) -> None:
        takeover = self.session.takeover
        _lightning.set_global_step(trainer, outcome.cohort_step)
        _lightning.set_logged_step(trainer, outcome.logger_step)
        takeover.apply(outcome)
        if outcome.requeue_signal is not None:  # SLURM asked for a requeue on some rank: checkpoint and requeue here
            _lightning.requeue_now(trainer, outcome.requeue_signal)
        if outcome.sigterm:
            self._save_preemption_checkpoint(trainer, outcome.cohort_step)
            _lightning.raise_sigterm_at_batch_end(trainer)
        if outcome.max_steps_reached:
            # Lightning then ends the fit after this batch exactly as under DDP: the same checkpoints,
            # ``min_steps`` long met, and no validation unless the epoch's data ends here too. A rank
            # whose share ``max_steps`` cut may have seen its loader run out: that is not the epoch's end.
            takeover.hand_back_max_steps(self.cohort.limits.max_steps)
            if outcome.data_left:
                _lightning.not_the_last_batch(trainer)
        if outcome.should_stop:
            trainer.should_stop = True

    def _user_values(self, trainer: "pl.Trainer") -> dict[str, float]:
        """This rank's latest value of each metric to roll up (NaN until it has logged one)."""
        logged = trainer.callback_metrics
        return {name: float(logged[name]) if name in logged else math.nan for name in self.cohort.scalar_reductions}

    def _save_preemption_checkpoint(self, trainer: "pl.Trainer", cohort_step: int) -> None:
        """SIGTERM reached the cohort: save here, at the boundary, on every rank, before all ranks stop.

        With Lightning's ``OnExceptionCheckpoint`` configured, that callback saves instead (the
        stop raises right after this batch, still at the boundary) and ``ckpt_path="last"`` finds it.
        """
        callbacks = _lightning.connector_attributes(trainer).callbacks
        if any(isinstance(callback, OnExceptionCheckpoint) for callback in callbacks):
            return
        path = _lightning.preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        rank_zero_info(
            f"ElChe: SIGTERM: every rank stops at step {cohort_step}; checkpoint written to {path}. "
            "A SLURM requeue resumes from it; elsewhere pass `ckpt_path=\"hpc\"` (or the path) to `Trainer.fit`."
        )


def _learning_rate(trainer: "pl.Trainer") -> Optional[float]:
    """The first optimizer's LR: what the LR-cliff watcher follows (None without an optimizer)."""
    optimizers = trainer.optimizers
    return float(optimizers[0].param_groups[0]["lr"]) if optimizers else None
