"""The controller callback: closes windows, runs boundaries, keeps the cohort in step.

Lightning gives a strategy no after-batch hook, so boundaries run here, in
``on_train_batch_end`` of a callback that the strategy puts first in ``trainer.callbacks``: after
the optimizer step and the step-interval schedulers, before any other callback (ModelCheckpoint
is moved last by Lightning) and before the validation check of the same batch, so validation
and checkpoints always see the consensus.
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint, Timer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elche.lightning import _lightning
from lightning_elche.lightning import telemetry
from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.cohort.controller import WindowReport

if TYPE_CHECKING:
    from lightning_elche.cohort.plan import EpochPlan
    from lightning_elche.lightning.strategy import ElCheStrategy


@dataclass
class BoundaryRecord:
    """What one boundary decided, kept for tests, logging and the end-of-fit summary."""

    epoch: int
    window: int
    steps: list[int]
    samples: list[int]
    window_ms: list[float]
    boundary_ms: float  # what this boundary cost this rank, waiting for the others included
    anchor: int
    counts: list[int]
    cohort_step: int
    divergence: float  # this rank's ||theta_before - theta_after|| / ||theta_after|| at this boundary
    cohort_divergence: float  # the largest rank's divergence at the previous boundary (same on every rank)
    cohort_divergence_mean: float
    verdict: str  # the convergence guard's: "stable", "suppress" (anchor held) or "nudge" (anchor cut)
    previous_boundary_ms: list[float] = field(default_factory=list)  # every rank's, at the boundary before
    user_scalars: dict[str, float] = field(default_factory=dict)  # ElCheStrategy(scalar_reductions=...) rolled up
    level: str = "global"  # "node": averaged inside each node only (ElCheStrategy(node_sync_every=m))


@dataclass
class _WindowClock:
    """This rank's progress through the current window."""

    plan: Optional["EpochPlan"] = None
    window: int = 0
    batches: int = 0
    train_ms: float = 0.0
    mark: float = field(default_factory=time.perf_counter)


class ElCheCallback(pl.Callback):
    """Runs ElChe boundaries; added automatically by :class:`~lightning_elche.ElCheStrategy`."""

    def __init__(self, strategy: "ElCheStrategy") -> None:
        self.strategy = strategy
        self.clock = _WindowClock()
        self.last_boundary_ms = 0.0
        self.last_divergence = 0.0
        self.history: list[BoundaryRecord] = []
        self._steps_at_batch_start = 0
        self._fit_started = time.perf_counter()
        self._progress_bar: Optional[pl.Callback] = None
        self._step_checkpoints: list[tuple[ModelCheckpoint, int]] = []
        self._step_timers: list[Timer] = []

    def take_over_step_timers(self, trainer: "pl.Trainer") -> None:
        """``Trainer(max_time=...)`` decided at boundaries from rank 0's clock, for every rank at once.

        Lightning's step-interval Timer broadcasts rank 0's verdict after every batch, which
        cannot pair up on uneven ranks. ElChe turns it into an epoch-interval Timer (whose check
        at epoch end is collective and consistent) and carries rank 0's elapsed time in each
        boundary's control data.
        """
        self._step_timers = [
            timer
            for timer in trainer.callbacks
            if isinstance(timer, Timer) and timer._duration is not None and timer._interval == "step"
        ]
        for timer in self._step_timers:
            timer._interval = "epoch"

    def restore_step_timers(self) -> None:
        for timer in self._step_timers:
            timer._interval = "step"
        self._step_timers = []

    def _time_is_up(self, rank0_train_s: float) -> bool:
        return any(rank0_train_s >= timer._duration for timer in self._step_timers)

    def take_over_step_checkpoints(self, trainer: "pl.Trainer") -> None:
        """``ModelCheckpoint(every_n_train_steps=N)`` saves at the first boundary at or past each multiple of N.

        Its own check runs per rank on the local step after every batch; ElChe disables it and
        opens it (``every_n_train_steps=1``) for exactly the boundary batches that cross a
        multiple of N cohort steps. ModelCheckpoint runs after this callback in the same batch.
        """
        self._step_checkpoints = [
            (checkpoint, checkpoint._every_n_train_steps)
            for checkpoint in trainer.checkpoint_callbacks
            if isinstance(checkpoint, ModelCheckpoint) and checkpoint._every_n_train_steps > 0
        ]
        self._open_step_checkpoints(0, 0)

    def restore_step_checkpoints(self) -> None:
        for checkpoint, every_n in self._step_checkpoints:
            checkpoint._every_n_train_steps = every_n
        self._step_checkpoints = []

    def _open_step_checkpoints(self, cohort_before: int, cohort_after: int) -> None:
        for checkpoint, every_n in self._step_checkpoints:
            crossed = cohort_after // every_n > cohort_before // every_n
            checkpoint._every_n_train_steps = 1 if crossed else 0

    @property
    def state_key(self) -> str:
        return "ElCheCallback"

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.checkpoint_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.load_checkpoint_state(state_dict)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.history.clear()
        self.last_boundary_ms = 0.0
        self.last_divergence = 0.0
        self._fit_started = time.perf_counter()
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(telemetry.CUSTOM_SCALARS_LAYOUT)
        self._show_in_progress_bar(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        rank_zero_info(telemetry.summary(self.history, time.perf_counter() - self._fit_started))

    def _show_in_progress_bar(self, trainer: "pl.Trainer") -> None:
        """Add the anchor and the shares to the progress bar's postfix (TQDM and Rich both ask get_metrics)."""
        bar = trainer.progress_bar_callback
        if bar is None or "get_metrics" in vars(bar):
            return
        original = bar.get_metrics

        def get_metrics(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
            metrics = original(trainer, pl_module)
            return {**metrics, **telemetry.progress_postfix(self.history[-1])} if self.history else metrics

        bar.get_metrics = get_metrics
        self._progress_bar = bar

    def restore_progress_bar(self) -> None:
        if self._progress_bar is not None:
            vars(self._progress_bar).pop("get_metrics", None)
            self._progress_bar = None

    def _publish(self, trainer: "pl.Trainer", record: BoundaryRecord, reason: str) -> None:
        """Rank 0 logs the boundary through the trainer's loggers: identical data, no collective."""
        if not trainer.loggers:
            return
        metrics = telemetry.boundary_metrics(record)
        metrics.update({f"elche/user/{name}": value for name, value in record.user_scalars.items()})
        metrics["elche/guard/suppress"] = float(sum(r.verdict == "suppress" for r in self.history))
        metrics["elche/guard/nudge"] = float(sum(r.verdict == "nudge" for r in self.history))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.cohort_step)
            if record.verdict != "stable" and isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(
                    "elche/guard", f"{record.verdict}: {reason or 'held'} (anchor {record.anchor})", record.cohort_step
                )

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.clock.mark = time.perf_counter()  # validation and epoch start-up are not training time
        self._hold_stop_request(trainer)  # e.g. EarlyStopping's, carried over while min_steps is unmet

    def _hold_stop_request(self, trainer: "pl.Trainer") -> None:
        """Keep ``trainer.should_stop`` from acting mid-window; the next boundary decides for all ranks.

        Lightning ends a rank's epoch after any batch in which ``should_stop`` is set, which on
        uneven ranks would leave the others waiting at the next boundary.
        """
        if trainer.should_stop:
            self.strategy.stop_requested = True
            trainer.should_stop = False

    def windows_closed(self, plan: "EpochPlan") -> int:
        """How many of ``plan``'s windows this rank has closed at a boundary."""
        return self.clock.window if self.clock.plan is plan else 0

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        strategy = self.strategy
        strategy.collectives_blocked = True  # until this batch closes a window
        self._steps_at_batch_start = strategy.window_steps
        progressed = self._window_progress(pl_module)
        if progressed is None:
            _lightning.set_logged_step(trainer, strategy.logged_step)
            return
        _lightning.set_logged_step(trainer, (strategy.logged_steps_total + progressed) // strategy.world_size)
        strategy.follow_schedules((strategy.cohort_steps_total + progressed) // strategy.world_size)

    def _logged_units(self, plan: "EpochPlan", window: int, automatic: bool) -> int:
        """Batches that step an optimizer in ``window``, all ranks: what Lightning's logger axis counts."""
        count = plan.steps if automatic else plan.batches
        return sum(count(window, rank) for rank in range(plan.world_size))

    def _window_progress(self, pl_module: "pl.LightningModule") -> Optional[int]:
        """How far this rank's next batch is into the window, in the window's units of all ranks.

        DDP runs batch i of every rank at step i. Here ranks run different numbers of batches per
        window, so each rank places its batches evenly over the window's DDP-equivalent steps.
        The loggers' step and step-interval LR schedules follow that position: it never runs
        backwards, never passes the window's end, and is exact and the same on every rank at
        every boundary (validation and epoch-end metrics land on DDP's steps). None outside a
        planned window.
        """
        strategy = self.strategy
        plan, clock = strategy.plan, self.clock
        if plan is None or clock.plan is not plan or clock.window >= len(plan.sizes):
            return None
        units = self._logged_units(plan, clock.window, pl_module.automatic_optimization)
        return clock.batches * units // plan.batches(clock.window, strategy.global_rank)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.strategy.collectives_blocked = False

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._hold_stop_request(trainer)
        self._open_step_checkpoints(0, 0)  # closed unless this batch is a boundary that crosses a multiple
        clock = self.clock
        plan = self.strategy.plan
        if plan is None:
            raise RuntimeError("ElChe has no epoch plan: the train DataLoader was not prepared by ElCheStrategy")
        if clock.plan is not plan:
            self.clock = clock = _WindowClock(plan=plan, mark=clock.mark)
        now = time.perf_counter()
        clock.train_ms += (now - clock.mark) * 1000.0
        clock.batches += 1
        rank = self.strategy.global_rank
        if clock.window >= len(plan.sizes):
            raise RuntimeError(
                f"rank {rank} trained more batches than ElChe planned for epoch {plan.epoch}; the train "
                "DataLoader must yield one batch per `batch_size` indices of its sampler"
            )
        if clock.batches >= plan.batches(clock.window, rank):
            self._boundary(trainer, plan)
        elif _lightning.is_last_batch(trainer):
            raise RuntimeError(
                f"rank {rank}'s train DataLoader ended inside window {clock.window} of epoch {plan.epoch} "
                f"after {clock.batches} of {plan.batches(clock.window, rank)} batches: ElChe cannot close the "
                "window. Does the dataset's length change during the epoch?"
            )
        clock.mark = time.perf_counter()

    def _boundary(self, trainer: "pl.Trainer", plan: "EpochPlan") -> None:
        strategy = self.strategy
        clock = self.clock
        rank = strategy.global_rank
        started = time.perf_counter()
        steps = strategy.take_window_steps()
        fields = {
            "window_ms": clock.train_ms,
            "samples": plan.sizes[clock.window][rank],
            "boundary_ms": self.last_boundary_ms,
            "fingerprint": plan.fingerprint(),
            "train_s": self._step_timers[0].time_elapsed() if self._step_timers else 0.0,
            "divergence": self.last_divergence,
            **self._user_scalars(trainer),
        }
        flags = {
            "sigterm": strategy.sigterm_pending,
            "stop": strategy.stop_requested,
            "requeue": strategy.requeue_signal is not None,
        }
        if strategy.liveness is not None:
            strategy.liveness.reached(len(self.history))
        report = LocalReport(steps=steps, fields=fields, flags=flags)
        with strategy.naming_lost_ranks():
            result = strategy.averager.exchange(
                report, needs_consensus=lambda control: self._needs_consensus(plan, control)
            )
        strategy.collectives_blocked = False  # every rank is at this boundary: collectives pair up
        control = result.control

        fingerprints = control.ints("fingerprint")
        if len(set(fingerprints)) != 1:
            raise RuntimeError(
                f"ElChe ranks disagree on the plan of epoch {plan.epoch} window {clock.window} "
                f"(fingerprints {fingerprints}): the train DataLoaders differ between ranks "
                "(dataset length, batch_size, num_workers or prefetch_factor must match)"
            )
        self._check_finite(control.ints("nonfinite"), result.averaged, plan)

        cohort_steps = control.ints("steps")
        previous_divergence = control.per_rank["divergence"]
        controller = strategy.controller
        cohort_before = strategy.cohort_step
        strategy.advance_cohort(sum(cohort_steps))
        verdict = strategy.governor.boundary(
            controller,
            WindowReport(
                window_ms=control.per_rank["window_ms"],
                steps=cohort_steps,
                boundary_ms=control.per_rank["boundary_ms"],
            ),
            previous_divergence=max(previous_divergence),
            lr=_first_learning_rate(trainer),
        )
        _lightning.set_global_step(trainer, strategy.cohort_step)
        automatic = trainer.lightning_module.automatic_optimization
        strategy.logged_steps_total += sum(cohort_steps) if automatic else self._logged_units(plan, clock.window, False)
        stepped_now = not automatic or steps > self._steps_at_batch_start
        _lightning.set_logged_step(trainer, strategy.logged_step - int(stepped_now))  # Lightning adds this batch
        self._open_step_checkpoints(cohort_before, strategy.cohort_step)

        clock.window += 1
        clock.batches = 0
        if not plan.complete:
            plan.freeze_ahead(clock.window, strategy.lookahead_batches, lambda: strategy.next_window_steps(plan))
        if control.flags["requeue"]:  # SLURM asked for a requeue on some rank: checkpoint and requeue here
            _lightning.requeue_now(trainer, strategy.requeue_signal or signal.SIGUSR1)
            strategy.requeue_signal = None
        if control.flags["sigterm"]:
            self._save_preemption_checkpoint(trainer)
            _lightning.raise_sigterm_at_batch_end(trainer)
        if strategy.max_steps_reached():
            strategy.release_max_steps(trainer)
        if control.flags["stop"] or self._time_is_up(control.per_rank["train_s"][0]):
            strategy.stop_requested = True
        if strategy.stop_requested and strategy.min_steps_met():
            trainer.should_stop = True
            strategy.stop_requested = False

        self.last_boundary_ms = (time.perf_counter() - started) * 1000.0
        self.history.append(
            BoundaryRecord(
                epoch=plan.epoch,
                window=clock.window - 1,
                steps=cohort_steps,
                samples=control.ints("samples"),
                window_ms=list(control.per_rank["window_ms"]),
                boundary_ms=self.last_boundary_ms,
                anchor=controller.anchor,
                counts=list(controller.counts),
                cohort_step=strategy.cohort_step,
                divergence=result.divergence,
                cohort_divergence=max(previous_divergence),
                cohort_divergence_mean=sum(previous_divergence) / len(previous_divergence),
                verdict=verdict.action,
                previous_boundary_ms=list(control.per_rank["boundary_ms"]),
                user_scalars=telemetry.roll_up(control.per_rank, strategy.scalar_reductions),
                level=result.level,
            )
        )
        if strategy.global_rank == 0:
            self._publish(trainer, self.history[-1], verdict.reason)
        self.last_divergence = result.divergence if math.isfinite(result.divergence) else 0.0
        clock.train_ms = 0.0

    def _user_scalars(self, trainer: "pl.Trainer") -> dict[str, float]:
        """This rank's latest value of each metric to roll up (NaN until it has logged one)."""
        logged = trainer.callback_metrics
        return {
            telemetry.user_field(name): float(logged[name]) if name in logged else math.nan
            for name in self.strategy.scalar_reductions
        }

    def _needs_consensus(self, plan: "EpochPlan", control: CohortControl) -> bool:
        """Whether this boundary must leave every rank with the same parameters (policy="async"):
        before validation at the epoch's end, a checkpoint, or a stop."""
        strategy = self.strategy
        if any(control.flags.values()) or (plan.complete and self.clock.window == len(plan.sizes) - 1):
            return True
        cohort_after = (strategy.cohort_steps_total + sum(control.ints("steps"))) // strategy.world_size
        checkpoint_due = any(
            cohort_after // every_n > strategy.cohort_step // every_n for _, every_n in self._step_checkpoints
        )
        max_steps_due = strategy.max_steps_would_be_reached(cohort_after)
        return checkpoint_due or max_steps_due or self._time_is_up(control.per_rank["train_s"][0])

    def _save_preemption_checkpoint(self, trainer: "pl.Trainer") -> None:
        """SIGTERM reached the cohort: save here, at the boundary, on every rank, before all ranks stop.

        With Lightning's ``OnExceptionCheckpoint`` configured, that callback saves instead (the
        stop raises right after this batch, still at the boundary) and ``ckpt_path="last"`` finds it.
        """
        if any(isinstance(callback, OnExceptionCheckpoint) for callback in trainer.callbacks):
            return
        path = _lightning.preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        rank_zero_info(
            f"ElChe: SIGTERM: every rank stops at step {self.strategy.cohort_step}; checkpoint written to {path}. "
            "A SLURM requeue resumes from it; elsewhere pass `ckpt_path=\"hpc\"` (or the path) to `Trainer.fit`."
        )

    def _check_finite(self, nonfinite: list[int], averaged: bool, plan: "EpochPlan") -> None:
        bad = [r for r, flag in enumerate(nonfinite) if flag]
        if not bad:
            return
        where = f"step {self.strategy.cohort_step} (epoch {plan.epoch}, window {self.clock.window})"
        if len(bad) == len(nonfinite):
            checkpoint = self.strategy.last_checkpoint_path
            raise FloatingPointError(
                f"ElChe: every rank has non-finite parameters at {where}; training stops. The parameters were reset "
                "to the last consensus, and the last consensus checkpoint is "
                f"{checkpoint if checkpoint else 'none (no checkpoint was written yet)'}. "
                "Lower the learning rate or enable gradient clipping before resuming."
            )
        if averaged and self.strategy.global_rank == min(r for r in range(len(nonfinite)) if r not in bad):
            warnings.warn(
                f"ElChe: rank(s) {bad} had non-finite parameters at {where}; they were left out of the average "
                "and reset to the consensus",
                RuntimeWarning,
                stacklevel=2,
            )


def _first_learning_rate(trainer: "pl.Trainer") -> Optional[float]:
    """The LR the LR-cliff watcher follows: identical on every rank, schedulers follow the cohort step."""
    optimizers = trainer.optimizers
    return float(optimizers[0].param_groups[0]["lr"]) if optimizers else None
