"""The train DataLoader under ElChe: its sampler put in, and dynamic dispatch's claim counter.

Mixed into :class:`~lightning_elche.ElCheStrategy`; the sampler itself is in ``data.py``, the
counter in ``comm/claims.py``. The strategy keeps the sampler so that an elastic cohort's next
generation can take it over (:meth:`CohortDispatch.rebind_sampler`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_elche.comm.claims import TicketCounter
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.data import ElCheSampler, describe_train_loader, reading_lanes, with_sampler

if TYPE_CHECKING:
    from lightning_elche.cohort.core import Cohort
    from lightning_elche.lightning.settings import ElCheSettings


class CohortDispatch:
    """Mixed into :class:`~lightning_elche.ElCheStrategy` ahead of DDPStrategy, whose ``process_dataloader`` it replaces."""

    cohort: Optional["Cohort"]
    settings: "ElCheSettings"
    _claims: Optional[TicketCounter]
    _sampler: Optional[ElCheSampler] = None  # the train loader's, re-bound when an elastic cohort changes
    _estimating_stepping_batches = False

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or self._estimating_stepping_batches:
            # `estimated_stepping_batches` in configure_optimizers (OneCycleLR's usual set-up) loads
            # the train loader before ElChe can plan an epoch: it sees DDP's sampler, hence DDP's
            # step count, which is also the DDP-equivalent global_step the schedule will follow.
            return dataloader
        cohort = self.cohort
        assert cohort is not None
        data, lookahead = describe_train_loader(dataloader, trainer.accumulate_grad_batches, self.seed)
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
            claiming=self.claiming, lanes=reading_lanes(dataloader, data),  # type: ignore[arg-type]
        )
        # Lightning creates (and prefetches from) the first iterator before it calls set_epoch.
        sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        return with_sampler(dataloader, data, sampler)  # type: ignore[arg-type]

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
