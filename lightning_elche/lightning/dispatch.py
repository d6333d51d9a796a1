"""The train DataLoader under ElChe: its sampler put in, this rank's micro-batch, and dynamic
dispatch's claim counter.

Mixed into :class:`~lightning_elche.ElCheStrategy`; the sampler itself is in ``data.py``, the
counter in ``comm/claims.py``. The strategy keeps the sampler so that an elastic cohort's next
generation can take it over (:meth:`CohortDispatch.rebind_sampler`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_elche.cohort.plan import TrainData
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.data import (
    ElCheSampler,
    describe_train_loader,
    rank_batch_sizes,
    reading_lanes,
    with_sampler,
)
from lightning_elche.lightning.host import StrategyHost

if TYPE_CHECKING:
    from lightning_elche.cohort.core import Cohort


class CohortDispatch(StrategyHost):
    """Mixed into :class:`~lightning_elche.ElCheStrategy` ahead of DDPStrategy, whose ``process_dataloader`` it replaces."""

    _sampler: Optional[ElCheSampler] = None  # the train loader's, re-bound when an elastic cohort changes
    _estimating_stepping_batches = False
    _user_accumulation: Optional[int] = None  # the Trainer's accumulate_grad_batches, before micro-batches changed it

    @override
    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None  # Lightning loads the train loader of a connected module
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or self._estimating_stepping_batches:
            # `estimated_stepping_batches` in configure_optimizers (OneCycleLR's usual set-up) loads
            # the train loader before ElChe can plan an epoch: it sees DDP's sampler, hence DDP's
            # step count, which is also the DDP-equivalent global_step the schedule will follow.
            return dataloader
        cohort = self.cohort
        assert cohort is not None
        if self._user_accumulation is None:
            self._user_accumulation = trainer.accumulate_grad_batches
        data, lookahead = describe_train_loader(dataloader, self._user_accumulation, self.seed)
        assert isinstance(dataloader, DataLoader)  # describe_train_loader refused anything else
        data = self._with_micro_batches(trainer, data)
        batch_size = data.rank_batch_size(self.global_rank)
        if cohort.data is None and self._resume is None and trainer.ckpt_path is not None:
            # A checkpoint written by another strategy (DDP, say): weights, optimizer and global_step carry over.
            cohort.adopt_steps(trainer.global_step, _lightning.logged_step(trainer))
            rank_zero_warn(
                f"ElChe: the checkpoint {trainer.ckpt_path} has no ElChe state (written by strategy='ddp'?). Weights, "
                "optimizer state and global_step are restored; if it was saved inside an epoch, that epoch restarts "
                "from its first sample, as it would under DDP."
            )
        cohort.set_train_data(data, lookahead)
        self._sampler = sampler = ElCheSampler(
            cohort.begin_epoch, rank=self.global_rank, counter=self._claims, chunk=cohort.claim_chunk,
            claiming=self.claiming, lanes=reading_lanes(dataloader, data, batch_size),
        )
        # Lightning creates (and prefetches from) the first iterator before it calls set_epoch. (Its type for
        # the fit loop's epoch tracker, a _ProcessedTracker, is the base class, which lacks `processed`.)
        sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
        return with_sampler(dataloader, data, sampler, batch_size)

    def _with_micro_batches(self, trainer: "pl.Trainer", data: TrainData) -> TrainData:
        """``data`` with every rank's batch size, and this rank accumulating over as many batches as make
        the user's step (Lightning scales each batch's loss by ``accumulate_grad_batches``, so the
        accumulated gradient is the mean over the step's samples, as with the full batch)."""
        micro = self.settings.micro_batch_sizes  # refused with manual optimization and accumulation schedules
        if micro is None:
            return data
        sizes = rank_batch_sizes(micro, self.world_size, data.batch_size)
        assert self._user_accumulation is not None
        trainer.accumulate_grad_batches = self._user_accumulation * data.batch_size // sizes[self.global_rank]
        return dataclasses.replace(data, rank_batch_sizes=sizes)

    def restore_accumulation(self, trainer: "pl.Trainer") -> None:
        """The Trainer's own ``accumulate_grad_batches`` again, after the fit."""
        if self._user_accumulation is not None:
            trainer.accumulate_grad_batches = self._user_accumulation
            self._user_accumulation = None

    def rebind_sampler(self, cohort: Cohort) -> None:
        """The train sampler serves ``cohort`` (a new generation's) from the next iterator on."""
        if self._sampler is not None:
            self._sampler.rebind(cohort.begin_epoch, self.global_rank, self._claims, cohort.claim_chunk)

    def _claim_counter(self, prefix: str, automatic_optimization: bool) -> Optional[TicketCounter]:
        """Dynamic dispatch's counter in the store, or None where this fit's dispatch is planned."""
        if self.settings.cohort.dispatch_mode(self.world_size) != "dynamic":
            return None
        counter = TicketCounter.from_default_group(self.world_size, prefix) if automatic_optimization else None
        if counter is None and self.settings.cohort.dispatch == "dynamic":
            why = (
                "counts one claimed ticket per optimizer step, which manual optimization does not tell it"
                if not automatic_optimization else "needs the rendezvous store, and this process group has none"
            )
            rank_zero_warn(f"ElChe: dispatch='dynamic' {why}; this fit uses dispatch='planned'")
        return counter

    @property
    def peek_claims(self) -> Optional[Callable[[int], int]]:
        """Reads dynamic dispatch's claim counter for an epoch (None under planned dispatch), inside
        :meth:`claiming` as the sampler's claims are."""
        counter = self._claims
        if counter is None:
            return None

        def peek(epoch: int) -> int:
            with self.claiming():
                return counter.peek(epoch)

        return peek
