"""One fit's cohort: the cohort core of the current generation and what it works with.

:class:`FitSession` is made in the strategy's ``setup`` and dropped at teardown. It owns the
cohort core (``cohort/core.py``), the boundary's averager (``comm/``), the liveness marks and
dynamic dispatch's claim counter, and builds all four again, on key prefixes of their own, when
an elastic cohort changes members (:meth:`FitSession.next_generation`): the core then carries the
fit over itself (:meth:`~lightning_elche.cohort.core.Cohort.next_generation`). The trainer's
settings ElChe took over live in the :class:`~lightning_elche.lightning.takeover.TrainerTakeover`
it holds, the train loader's sampler in its :class:`~lightning_elche.lightning.dispatch.TrainDispatch`.
"""

from __future__ import annotations

import dataclasses
import itertools
from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elche.cohort.claims import Claiming
from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.records import user_field
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.averaging import Averager, AveragingSpec, make_averager
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.comm.groups import boundary_group, gather_to_all
from lightning_elche.comm.liveness import FailurePlace, Liveness, naming_a_lost_store
from lightning_elche.lightning.dispatch import TrainDispatch
from lightning_elche.lightning.settings import ElCheSettings
from lightning_elche.lightning.takeover import TrainerTakeover
from lightning_elche.lightning.validation import ValidationSplit

_FIT_NUMBERS = itertools.count(1)  # the same sequence on every rank: keys of one fit never meet another's


class Ranks(Protocol):
    """What the session reads of the strategy: where this rank stands now (it changes in an elastic fit)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...


class Members(Protocol):
    """What the session reads of the membership mode (``world.py``): who is in the current generation."""

    @property
    def generation(self) -> Optional[int]: ...  # None: a fixed world

    @property
    def control_fields(self) -> list[str]: ...

    def members(self, world_size: int) -> Sequence[int]: ...

    def nodes(self, world_size: int) -> Optional[list[int]]: ...


class FitSession:
    """The cohort of one fit, rebuilt for each generation of an elastic one."""

    def __init__(
        self, trainer: "pl.Trainer", ranks: Ranks, settings: ElCheSettings, takeover: TrainerTakeover,
        world: Members,
    ) -> None:
        self.trainer = trainer
        self.ranks = ranks
        self.settings = settings
        self.takeover = takeover
        self.world = world
        self.validation = ValidationSplit()  # whether validation may be split by speed (lightning/validation.py)
        self.dispatch = TrainDispatch(
            settings.data, trainer.accumulate_grad_batches, takeover.batch_limit, fixed=world.generation is None
        )
        self._fit_prefix = f"elche/fit{next(_FIT_NUMBERS)}"  # the same on every rank: each counts the same fits
        self.prefix = self._fit_prefix
        self.cohort: Cohort
        self.averager: Averager
        self.liveness: Optional[Liveness] = None
        self.claims: Optional[TicketCounter] = None

    @property
    def module(self) -> "pl.LightningModule":
        return self.trainer.lightning_module

    def begin(self, resume: Optional[ResumePoint]) -> Cohort:
        """The first generation's cohort, resumed from ``resume`` if the fit resumes from a checkpoint."""
        self._build(self.world.generation)
        self.cohort = Cohort(
            self._controller_config(), self.settings.cohort.make_guard(), rank=self.ranks.global_rank,
            limits=self.takeover.limits, automatic_optimization=self.module.automatic_optimization,
            scalar_reductions=self.settings.reporting.reductions, resume=resume, dispatch=self._dispatch_mode(),
            warn=rank_zero_warn,
        )  # fmt: skip
        self.cohort.note_checkpoint(None if self.trainer.ckpt_path is None else str(self.trainer.ckpt_path))
        return self.cohort

    def members(self) -> Sequence[int]:
        """The cohort's member ids in rank order (a fixed world's: its ranks)."""
        return self.world.members(self.ranks.world_size)

    def next_generation(self, point: Optional[ResumePoint]) -> Cohort:
        """The cohort of the membership's current generation (this rank's group already entered), resumed
        in memory from ``point`` (None: from the fit's start, nothing trained yet); the train sampler serves it
        from the next iterator on. The outer optimizer's global model and momentum go on as they were (they are
        the same on every member)."""
        outer = self.settings.outer_optimizer
        carried = None if outer is None else outer.carry()
        self._build(self.world.generation)
        if outer is not None:
            outer.restore(carried)
        old = self.cohort
        data = None if old.data is None else self.dispatch.for_members(old.data, self.members())
        self.cohort = old.next_generation(self.ranks.global_rank, self._controller_config(), point, data, self._dispatch_mode())
        self.dispatch.rebind(self.cohort, self.claiming())
        return self.cohort

    def carry_averager_state(self, mine: dict[str, Any]) -> None:
        """The new generation's averager goes on from every survivor's state (``mine``: this rank's, as it
        was before the boundary that lost a member: its error feedback, what it had not sent yet); a lost
        rank's unsent change is lost with its window. A gather among the survivors, where there is state."""
        if mine:  # an averager kind that keeps state keeps it on every rank
            self.averager.load_state_dicts(gather_to_all(mine, self.ranks.world_size, None))

    def _build(self, generation: Optional[int]) -> None:
        """The averager, liveness marks and claim counter of the current world, on the generation's keys."""
        settings, ranks, module = self.settings, self.ranks, self.module
        self.prefix = self._fit_prefix if generation is None else f"{self._fit_prefix}/g{generation}"
        self.claims = self._claim_counter(f"{self.prefix}/claims")
        averaging, links = settings.averaging, settings.links
        self.averager = make_averager(
            module,
            rank=ranks.global_rank,
            world_size=ranks.world_size,
            device=ranks.root_device if averaging.reduce_on == "device" else torch.device("cpu"),
            group=boundary_group(averaging.reduce_on, settings.timeout),
            spec=AveragingSpec(
                policy=averaging.policy, gamma=averaging.gamma, outer=settings.outer_optimizer,
                easgd_alpha=averaging.easgd_alpha, node_sync_every=averaging.node_sync_every,
                ranks_per_node=averaging.ranks_per_node or ranks.num_processes,
                nodes=self.world.nodes(ranks.world_size), compression=links.compression, fragments=links.fragments,
                link_delay=None if links.simulated_link is None else links.simulated_link.seconds,
                timeout=settings.timeout,
            ),  # fmt: skip
            extra_fields=[*(user_field(name) for name in settings.reporting.reductions), *self.world.control_fields],
        )
        self.liveness = Liveness.from_default_group(ranks.global_rank, ranks.world_size, prefix=self.prefix)

    def _controller_config(self) -> ControllerConfig:
        settings = self.settings
        return dataclasses.replace(
            settings.cohort.controller_config(self.ranks.world_size), boundary_bytes=self.averager.payload_bytes,
            link_mbit_s=settings.links.link_mbit_s, link_latency_ms=settings.links.link_latency_ms,
        )

    def _dispatch_mode(self) -> str:
        return "planned" if self.claims is None else "dynamic"

    def _claim_counter(self, prefix: str) -> Optional[TicketCounter]:
        """Dynamic dispatch's counter in the store, or None where this fit's dispatch is planned."""
        data, world_size = self.settings.cohort, self.ranks.world_size
        if data.dispatch_mode(world_size, self.takeover.limits.has_step_milestones) != "dynamic":
            return None
        automatic = self.module.automatic_optimization
        timeout_s = self.settings.timeout.total_seconds()  # a claim waits for the store no longer than a collective
        counter = TicketCounter.from_default_group(world_size, timeout_s, prefix) if automatic else None
        if counter is None and data.dispatch == "dynamic":
            why = (
                "counts one claimed ticket per optimizer step, which manual optimization does not tell it"
                if not automatic else "needs the rendezvous store, and this process group has none"
            )
            rank_zero_warn(f"ElChe: dispatch='dynamic' {why}; this fit uses dispatch='planned'")
        return counter

    # ------------------------------------------------------------------ claims and failures

    def claiming(self) -> Claiming:
        """How this rank's sampler claims under dynamic dispatch (nothing under planned dispatch): each claim
        sent as the last ticket held is handed out, so its round trip overlaps the step (``benchmarks/step_cost.py``)."""
        return Claiming(self.claims, self.cohort.claim_chunk, self._naming_a_lost_store, self.dispatch.lanes, ahead=True)

    def _naming_a_lost_store(self) -> AbstractContextManager[None]:
        """Claims between boundaries: a store that stopped answering (its host died) becomes an error
        saying so and naming the last checkpoint, not a bare socket error."""
        place = lambda: self.failure_place(  # noqa: E731
            "under dynamic dispatch", operation="claiming the next step from the rendezvous store"
        )
        return naming_a_lost_store(self.settings.timeout.total_seconds(), place)

    def peek_claims(self) -> Optional["PeekClaims"]:
        """Reads dynamic dispatch's claim counter for an epoch (None under planned dispatch), inside the
        same error naming as the sampler's claims."""
        counter = self.claims
        if counter is None:
            return None

        def peek(epoch: int) -> int:
            with self._naming_a_lost_store():
                return counter.peek(epoch)

        return peek

    def failure_place(self, during: Optional[str] = None, operation: str = "a collective") -> FailurePlace:
        """Where the cohort stands, for a failure message."""
        cohort = self.cohort
        return FailurePlace(
            boundary=len(cohort.history),
            epoch=cohort.plan.epoch if cohort.plan is not None else -1,
            window=cohort.clock.window,
            cohort_step=cohort.cohort_step,
            last_checkpoint=cohort.last_checkpoint_path,
            during=during,
            operation=operation,
        )


class PeekClaims(Protocol):
    def __call__(self, epoch: int) -> int: ...
