"""The cohort core: where the cohort is, and what it decides at every boundary.

One :class:`Cohort` per rank and fit owns everything that makes up "where the cohort is": the
epoch plan, this rank's window clock, the step counters, the stop / SIGTERM / requeue flags, the
controller, the convergence governor and the history of boundaries. A boundary is
:meth:`Cohort.local_report` (what this rank contributes) -> an exchange done by ``comm/`` (or
by the simulator) -> :meth:`Cohort.boundary` (the decision, the same on every rank) -> an
:class:`~lightning_elche.cohort.records.Outcome` that the Lightning adapter applies.

No Lightning, no torch.distributed and no clock: times come in as arguments, so unit tests and
the cohort simulator drive this very object without processes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Mapping, Optional

from lightning_elche.cohort.claims import Claims, claim_chunk, claims_too_costly
from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.cohort.controller import Controller, ControllerConfig, WindowReport
from lightning_elche.cohort.epoch import Epoch
from lightning_elche.cohort.fingerprint import check_fingerprints
from lightning_elche.cohort.finite import check_finite
from lightning_elche.cohort.governor import AnchorGovernor
from lightning_elche.cohort.guards import ConvergenceGuard, Verdict
from lightning_elche.cohort.limits import NO_LIMITS, EpochMilestones, FitLimits
from lightning_elche.cohort.plan import WindowClock
from lightning_elche.cohort.records import BoundaryRecord, Outcome, boundary_record, roll_up, user_field
from lightning_elche.cohort.requests import PendingRequests
from lightning_elche.cohort.resume import OptimizerStates, ResumePoint
from lightning_elche.cohort.train_data import TrainData


class Cohort:
    """The replicated state machine of one fit, seen from rank ``rank``.

    Args:
        config: the controller's settings (policy, anchor bounds, overhead target, shares).
        guard: the convergence guard the governor consults at every boundary.
        rank: this rank (the cohort's size is ``config.world_size``).
        limits: the fit's step and time limits (:class:`~lightning_elche.cohort.limits.FitLimits`).
        automatic_optimization: the LightningModule's; manual optimization counts batches on the
            loggers' axis, automatic counts the batches that stepped.
        scalar_reductions: users' per-rank metrics rolled up across ranks (name -> reduction).
        resume: the checkpoint's ElChe state when the fit resumes from one.
        dispatch: "planned" (shares decided a window ahead, ``plan.py``) or "dynamic" (the ranks
            claim one-step tickets from the window's pool, ``pool.py``; automatic optimization only).
        warn: how to warn the user (the adapter passes Lightning's rank-zero warning).
    """

    def __init__(
        self,
        config: ControllerConfig,
        guard: ConvergenceGuard,
        *,
        rank: int,
        limits: FitLimits = NO_LIMITS,
        automatic_optimization: bool = True,
        scalar_reductions: Mapping[str, str] = {},
        resume: Optional[ResumePoint] = None,
        dispatch: str = "planned",
        warn: Callable[[str], None] = warnings.warn,
    ) -> None:
        self.rank = rank
        self.world_size = config.world_size
        self.dynamic = dispatch == "dynamic" and automatic_optimization
        self.controller = Controller(dataclasses.replace(config, amortize_waits=self.dynamic))
        self.governor = AnchorGovernor(guard)
        self.limits = limits
        self.automatic_optimization = automatic_optimization
        self.scalar_reductions = dict(scalar_reductions)
        self.warn = warn
        self.resume = resume
        self.data: Optional[TrainData] = None
        self.lookahead_batches = 1
        self.plan: Optional[Epoch] = None
        self.clock = WindowClock()
        self.history: list[BoundaryRecord] = []
        self.cohort_steps_total = 0  # optimizer steps of all ranks
        self.logged_steps_total = 0  # batches that stepped an optimizer, all ranks (the loggers' axis)
        self.window_steps = 0  # this rank's optimizer steps since the last boundary
        self.in_window = False  # between a batch's start and its boundary: no collective can pair up
        self.requests = PendingRequests()
        self.last_checkpoint_path: Optional[str] = None  # the last consensus checkpoint a restart can use
        self.last_boundary_ms = 0.0
        self.last_divergence = 0.0
        self._batch_stepped = False  # the current batch stepped an optimizer: Lightning adds it to the loggers' step
        self._pending: Optional[BoundaryRecord] = None
        self._stopping = False  # the last boundary ended the fit (stop, SIGTERM, requeue, max_steps)
        self._epoch_ms = [0.0, 0.0]  # all ranks' time claiming and training in the current epoch
        self.milestones = EpochMilestones(limits)  # the current epoch's validation and checkpoint steps
        if resume is not None:
            self._restore(resume)
        self._checkpoint_step = self.cohort_step  # at the last boundary where step checkpoints could open

    def next_generation(
        self, rank: int, config: ControllerConfig, point: Optional[ResumePoint], data: Optional[TrainData], dispatch: str
    ) -> "Cohort":
        """The cohort of an elastic fit's next generation on this member, its rank there ``rank`` and its
        controller ``config`` (the new world size and boundary cost), resumed in memory from ``point``
        (where the old generation's survivors, or its members with the joiners, agreed to go on; None: in set-up).

        What is the fit's rather than the generation's carries over: the limits, the history, the last
        checkpoint, the requests waiting for a boundary (SIGTERM, a stop, SLURM's requeue) and the train
        data (``data``: as the new members batch it); the rest of the epoch is planned again for the new
        world from ``point``, under ``dispatch`` (a cohort of one rank plans: nobody to share a pool with)."""
        cohort = Cohort(
            config, self.governor.guard, rank=rank, limits=self.limits, automatic_optimization=self.automatic_optimization,
            scalar_reductions=self.scalar_reductions, resume=point, dispatch=dispatch, warn=self.warn,
        )  # fmt: skip
        cohort.history = list(self.history)
        cohort.last_checkpoint_path = self.last_checkpoint_path
        cohort.requests = self.requests
        data = self.data if data is None else data
        if data is not None:
            cohort.set_train_data(data, self.lookahead_batches)
        return cohort

    def note_checkpoint(self, path: Optional[str]) -> None:
        """``path`` holds this fit's consensus now (written at a boundary, or the one the fit resumed
        from): what a restart resumes from, and what failure messages name."""
        self.last_checkpoint_path = path

    def note_membership_change(self, record: BoundaryRecord) -> None:
        """The boundary at which the cohort changed members (the survivors' average, or an admission)."""
        self.history.append(record)

    def fit_ended(self) -> None:
        """The fit is over: no window is open any more (Lightning's collectives after it pair up)."""
        self.in_window = False

    def _restore(self, resume: ResumePoint) -> None:
        self.controller.load_state_dict(resume.controller)
        if resume.governor is not None:
            try:
                self.governor.load_state_dict(resume.governor)
            except (KeyError, TypeError, ValueError) as error:
                self.warn(f"ElChe: the checkpoint's convergence-guard state does not fit this guard "
                          f"({type(error).__name__}: {error}); the guard starts afresh")
        self.cohort_steps_total, self.logged_steps_total = resume.totals_for(self.world_size)

    # ------------------------------------------------------------------ steps

    @property
    def cohort_step(self) -> int:
        """The DDP-equivalent step: total optimizer steps of all ranks divided by the world size."""
        return self.cohort_steps_total // self.world_size

    @property
    def logged_step(self) -> int:
        """The loggers' DDP-equivalent step: batches that stepped an optimizer, all ranks, over the world size."""
        return self.logged_steps_total // self.world_size

    def adopt_steps(self, global_step: int, logged_step: int) -> None:
        """Continue from a checkpoint without ElChe state (another strategy's): its steps carry over."""
        self.cohort_steps_total = global_step * self.world_size
        self.logged_steps_total = logged_step * self.world_size
        self._checkpoint_step = self.cohort_step

    def _steps_left(self) -> Optional[int]:
        return self.limits.steps_left(self.cohort_steps_total, self.world_size)

    # ------------------------------------------------------------------ data

    def set_train_data(self, data: TrainData, lookahead_batches: int) -> None:
        """The train DataLoader as the plan sees it; the first one of a resumed fit must fit the checkpoint."""
        if self.data is None and self.resume is not None:
            self.resume.check_fits(data, self.last_checkpoint_path, self.warn)
        self.data = data
        self.lookahead_batches = lookahead_batches

    def begin_epoch(self, epoch: int) -> Epoch:
        """Build the epoch's plan from the replicated controller and open its first windows."""
        if self.data is None:
            raise RuntimeError("ElChe has no train data to plan: the train DataLoader was not prepared by ElCheStrategy")
        resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
        if resume is None and (previous := self.plan) is not None and self.clock.untouched(previous, epoch):
            return previous  # Lightning dropped an iterator before training from it: see WindowClock.untouched
        self._check_claim_cost(epoch)
        covered, seed = (resume.covered, resume.seed) if resume is not None else (None, None)
        plan = self.data.plan(epoch, self.world_size, covered, dynamic=self.dynamic, covered_seed=seed)
        if resume is not None and plan.complete and not plan.window_count:
            # The checkpoint closed its epoch (saved at the last boundary or at validation): Lightning
            # moves on to the next epoch without creating another iterator, so this one serves it.
            plan = self.data.plan(epoch + 1, self.world_size, dynamic=self.dynamic)
        plan.limit(self._steps_left())
        data = self.data
        start = resume.epoch_start(data.samples_per_step) if resume is not None and plan.epoch == epoch else self.cohort_step
        ddp_batches = None if data.num_samples is None else data.ddp_batches(self.world_size)
        self.milestones = EpochMilestones.of_epoch(self.limits, plan.epoch, start, ddp_batches, data.accumulation)
        self.controller.set_max_total_steps(plan.total_steps)
        self.plan, self.clock = plan, WindowClock(plan=plan, mark_s=self.clock.mark_s)
        self._open_windows(plan, 0)
        return plan

    def _check_claim_cost(self, epoch: int) -> None:
        """Fall back to planned dispatch when claiming cost too much of the last epoch (a slow or busy store)."""
        (claim_ms, train_ms), self._epoch_ms = self._epoch_ms, [0.0, 0.0]
        if self.dynamic and (warning := claims_too_costly(claim_ms, train_ms, epoch)) is not None:
            self.dynamic = self.controller.config.amortize_waits = False
            self.warn(warning)

    def _open_windows(self, plan: Epoch, next_window: int) -> None:
        """Decide the windows the DataLoader may reach before the boundary that closes ``next_window - 1``."""

        def cap(ahead: int) -> Optional[int]:  # a window ``ahead`` steps from now ends on the next milestone
            return self.milestones.window_cap(self.cohort_steps_total + ahead, self.world_size)

        plan.open_windows(next_window, lambda: self.controller.counts, self.rank, self.lookahead_batches, cap)

    def windows_closed(self, plan: Epoch) -> int:
        return self.clock.window if self.clock.plan is plan else 0

    # ------------------------------------------------------------------ batches

    def batch_started(self) -> tuple[int, Optional[int]]:
        """A batch begins: the loggers' step for it and the step LR schedules follow (None: stay).

        DDP runs batch i of every rank at step i. Here ranks run different numbers of batches per
        window, so each rank places its batches evenly over the window's DDP-equivalent steps: the
        position never runs backwards, never passes the window's end, and is exact and the same on
        every rank at every boundary (validation and epoch-end metrics land on DDP's steps).
        """
        self.in_window = True  # until this batch closes a window
        self._batch_stepped = False
        plan, clock = self.plan, self.clock
        if plan is None or clock.window >= plan.window_count:
            return self.logged_step, None
        units = plan.logged_units(clock.window, self.automatic_optimization)
        progressed = plan.progress(clock.window, self.rank, clock.batches, units, self.controller.shares[self.rank])
        return (
            (self.logged_steps_total + progressed) // self.world_size,
            (self.cohort_steps_total + progressed) // self.world_size,
        )

    def optimizer_stepped(self) -> None:
        self.window_steps += 1
        self._batch_stepped = True

    def start_clock(self, now_s: float) -> None:
        """Training (re)starts now: at an epoch's start and after a boundary (neither is training time)."""
        self.clock.mark_s = now_s

    def batch_ended(self, now_s: float, last_batch: bool, peek: Optional[Callable[[int], int]] = None) -> bool:
        """A batch ended at ``now_s``: does it close this rank's window? (``peek``: see ``PoolEpoch.batch_trained``.)"""
        plan, clock = self.plan, self.clock
        if plan is None:
            raise RuntimeError("ElChe has no epoch plan: the train DataLoader was not prepared by ElCheStrategy")
        clock.train_ms += (now_s - clock.mark_s) * 1000.0
        clock.mark_s = now_s
        clock.batches += 1
        return plan.batch_trained(clock.window, self.rank, clock.batches, last_batch, peek)

    def claim_chunk(self, round_trip_ms: float) -> int:
        """Tickets this rank takes per claim under dynamic dispatch (``pool.claim_chunk``)."""
        return claim_chunk(round_trip_ms, self.controller.ms_per_step[self.rank], self.controller.window_ms)

    def boundary_due(self) -> bool:
        """After a boundary: another before the next batch? (Dynamic dispatch: an ended epoch's windows close.)"""
        plan = self.plan
        return plan is not None and not self._stopping and plan.boundary_due(self.clock.window)

    def epoch_ended(self) -> None:
        self.in_window = False

    # ------------------------------------------------------------------ boundary

    def local_report(
        self, train_s: float = 0.0, user_values: Mapping[str, float] = {}, lr: Optional[float] = None,
        clock_due: int = 0, validation_ms: float = 0.0,
    ) -> LocalReport:
        """This rank's contribution to the boundary that closes its window; resets the window's step count.

        ``train_s`` is rank 0's training clock for ``max_time``, ``clock_due`` what its clock says is due
        (``limits.CLOCK_VALIDATION`` and ``limits.time_checkpoint_bit``); ``user_values`` this rank's latest
        value of each metric in ``scalar_reductions`` (NaN until it has logged one); ``lr`` the
        learning rate its last batch trained with (None without an optimizer); ``validation_ms`` its last
        validation's ms per sample (0: none), which validation's split by speed reads from every rank."""
        plan, clock = self.plan, self.clock
        assert plan is not None
        steps, self.window_steps = self.window_steps, 0
        fields = {
            "window_ms": clock.train_ms,
            "samples": plan.trained_samples(clock.window, self.rank),
            "claim_ms": plan.window_claim_ms,
            "boundary_ms": self.last_boundary_ms,
            **plan.fingerprints(),
            "train_s": train_s,
            "clock_due": float(clock_due),
            "validation_ms": validation_ms,
            "divergence": self.last_divergence,
            "lr": math.nan if lr is None else float(lr),
            **{user_field(name): float(user_values.get(name, math.nan)) for name in self.scalar_reductions},
        }
        return LocalReport(steps=steps, fields=fields, flags={**self.requests.flags(), "finished": plan.finished})

    def needs_consensus(self, control: CohortControl) -> bool:
        """Whether this boundary must leave every rank with the same parameters (async, hierarchical):
        before validation at the epoch's end, a checkpoint, a stop, or the end of the fit."""
        plan = self.plan
        assert plan is not None
        if any(control.flags.values()) or plan.is_final(self.clock.window):
            return True
        after = (self.cohort_steps_total + sum(control.ints("steps"))) // self.world_size
        rank0_clock = control.per_rank["clock_due"][0]
        return self.milestones.consensus_due(self.cohort_step, after, int(rank0_clock)) or self._time_is_up(control)

    def _time_is_up(self, control: CohortControl) -> bool:
        return self.limits.time_is_up(control.per_rank["train_s"][0])  # rank 0's clock

    def boundary(
        self,
        control: CohortControl,
        divergence: float,
        averaged: bool,
        level: str = "global",
    ) -> Outcome:
        """Decide, from the exchanged control data, everything the next window needs; the same on every rank.

        ``divergence`` is this rank's drift from the new consensus, ``averaged`` whether any rank
        contributed, ``level`` "global" or "node".
        """
        self.in_window = False  # every rank is at this boundary: collectives pair up
        plan, clock = self.plan, self.clock
        assert plan is not None
        check_fingerprints(control, plan.epoch, clock.window)  # raises on every rank alike, naming what differs
        where = f"step {self.cohort_step} (epoch {plan.epoch}, window {self.clock.window})"
        check_finite(control.ints("nonfinite"), averaged, self.rank, where, self.last_checkpoint_path)
        # A rank whose epoch ran out closes the windows left in one batch, the others over several:
        # step checkpoints (saved after a batch) wait for the epoch's final boundary, the same on all.
        epoch_ends = plan.is_final(clock.window)
        checkpointable = epoch_ends or not control.flags["finished"]
        verdict = self._count(control, plan)
        step_before = self._checkpoint_step if checkpointable else self.cohort_step
        stepped_now = not self.automatic_optimization or self._batch_stepped  # at every boundary this batch closes
        clock.window += 1
        clock.batches = 0
        plan.window_closed()
        self._open_windows(plan, clock.window)
        requeue, should_stop = self.requests.take(control, self._time_is_up(control), self.limits.may_stop(self.cohort_step))
        self._pending = boundary_record(
            plan.epoch, clock.window - 1, control, self.controller, self.cohort_step, divergence, verdict.action,
            roll_up(control.per_rank, self.scalar_reductions), level,
        )  # fmt: skip
        self.last_divergence = divergence if math.isfinite(divergence) else 0.0
        outcome = Outcome(
            cohort_step=self.cohort_step,
            cohort_step_before=step_before,
            logger_step=self.logged_step - int(stepped_now),
            requeue_signal=requeue,
            sigterm=control.flags["sigterm"],
            max_steps_reached=self.limits.reached(self.cohort_step),
            data_left=plan.data_left_after(clock.window - 1),
            should_stop=should_stop,
            guard_reason=verdict.reason,
            **self.milestones.acted_on(step_before, self.cohort_step, epoch_ends, int(control.per_rank["clock_due"][0]))
            if checkpointable else {},
        )
        self._stopping = outcome.stops
        if checkpointable:
            self._checkpoint_step = self.cohort_step
        return outcome

    def _count(self, control: CohortControl, plan: Epoch) -> Verdict:
        """Add the window's steps to the counters and let the governor plan the next window."""
        steps = control.ints("steps")
        self.cohort_steps_total += sum(steps)
        self._epoch_ms[0] += math.fsum(control.per_rank["claim_ms"])
        self._epoch_ms[1] += math.fsum(control.per_rank["window_ms"])
        report = WindowReport(window_ms=control.per_rank["window_ms"], steps=steps, boundary_ms=control.per_rank["boundary_ms"])
        # Rank 0's LR (NaN: no optimizer): under dynamic dispatch step schedules follow each rank's own estimate.
        divergence = max(control.per_rank["divergence"])
        verdict = self.governor.boundary(self.controller, report, divergence, lr=control.per_rank["lr"][0])
        self.logged_steps_total += sum(steps) if self.automatic_optimization else plan.logged_units(self.clock.window, False)
        return verdict

    def close_boundary(self, boundary_ms: float) -> BoundaryRecord:
        """The boundary is over (its outcome applied): record what it cost this rank; the window restarts."""
        record, self._pending = self._pending, None
        assert record is not None, "close_boundary() without a boundary()"
        record.boundary_ms = self.last_boundary_ms = boundary_ms
        self.history.append(record)
        self.clock.train_ms = 0.0
        return record

    # ------------------------------------------------------------------ checkpoints

    def at_boundary(self) -> bool:
        """Whether every rank holds the consensus now, so a checkpoint may be taken."""
        return not self.in_window and self.clock.batches == 0

    def resume_point(
        self, optimizer_states: Callable[[], Optional[OptimizerStates]], outer: Optional[dict[str, Any]],
        all_claims: Callable[[Claims], list[Claims]] = lambda claims: [claims],
    ) -> Optional[ResumePoint]:
        """The cohort's part of a checkpoint taken now (None before the first epoch is planned, unless resumed).

        ``optimizer_states()`` gathers every rank's optimizer states and ``all_claims(mine)`` every
        rank's claims (dynamic dispatch), collectives: they run only once the checkpoint is known to
        be at a boundary.
        """
        plan, data = self.plan, self.data
        if plan is None or data is None:  # a cohort resumed in memory at an epoch's end, not planned yet
            if self.resume is None:
                return None
            return dataclasses.replace(
                self.resume, world_size=self.world_size, cohort_steps_total=self.cohort_steps_total,
                logged_steps_total=self.logged_steps_total, controller=self.controller.state_dict(),
                governor=self.governor.state_dict(), optimizer_states=optimizer_states(), outer=outer,
            )  # its checkpoint is the point it resumed from, with its counters and states now
        if not self.at_boundary():
            raise RuntimeError(
                f"ElChe checkpoints are taken at window boundaries, where every rank holds the consensus; rank "
                f"{self.rank} was asked to save inside window {self.clock.window} of epoch {plan.epoch}. Save from "
                "`on_train_epoch_end` or validation, or use ModelCheckpoint(every_n_train_steps=N), which ElChe "
                "moves to boundaries."
            )
        assert data.num_samples is not None
        return ResumePoint(
            epoch=plan.epoch,
            num_samples=data.num_samples,
            covered=plan.covered_at(self.windows_closed(plan), all_claims),
            seed=data.seed,
            world_size=self.world_size,
            cohort_steps_total=self.cohort_steps_total,
            logged_steps_total=self.logged_steps_total,
            controller=self.controller.state_dict(),
            optimizer_states=optimizer_states(),
            outer=outer,
            governor=self.governor.state_dict(),
            epoch_start_step=self.milestones.start_step,
            order_digest=data.drawn_digest(plan.epoch),
        )
