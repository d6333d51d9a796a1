"""The train DataLoader under ElChe: its sampler put in, and this rank's micro-batch.

:class:`TrainDispatch` owns, for one fit, the train loader's :class:`~lightning_elche.lightning.data.ElCheSampler`
(re-bound when an elastic cohort changes members) and the Trainer's ``accumulate_grad_batches`` it
changes for per-rank micro-batches (given back at teardown). The sampler itself is in ``data.py``;
how it claims under dynamic dispatch (:class:`~lightning_elche.cohort.pool.Claiming`) comes from the
fit's session, which owns the claim counter.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_elche.cohort.claims import Claiming
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.data import (
    ElCheSampler,
    describe_train_loader,
    rank_batch_sizes,
    reading_lanes,
    with_sampler,
)
from lightning_elche.lightning.streaming import shared_remote_chunks

if TYPE_CHECKING:
    from lightning_elche.cohort.core import Cohort
    from lightning_elche.lightning.settings import Data


class TrainDispatch:
    """The train loader's sampler and this rank's micro-batch, for one fit."""

    def __init__(
        self, settings: "Data", user_accumulation: int, batch_limit: Optional[Union[int, float]], fixed: bool
    ) -> None:
        self.settings = settings
        self._batch_limit = batch_limit  # the user's limit_train_batches (None: whole epochs)
        self.fixed = fixed  # a fixed world's members are its ranks (an elastic one's change)
        self._user_accumulation = user_accumulation  # the Trainer's accumulate_grad_batches, before micro-batches
        self._sampler: Optional[ElCheSampler] = None
        self.lanes = 1  # reading lanes of the sampler's claims (reading_lanes)

    def train_loader(
        self, dataloader: object, trainer: "pl.Trainer", cohort: "Cohort", claiming: Callable[[], Claiming],
        members: Sequence[int],
    ) -> DataLoader:
        """The train loader re-made around ElChe's sampler for ``cohort`` (refuses what cannot be split);
        ``claiming()`` says how its sampler claims, once the loader's reading lanes are known; ``members``:
        the cohort's member ids in rank order (what micro-batch sizes are keyed by)."""
        endless_epoch = self._fit_samples(dataloader, cohort, len(members))
        data, lookahead = describe_train_loader(dataloader, self._user_accumulation, self.settings.seed, endless_epoch)
        data = dataclasses.replace(data, batch_limit=self._batch_limit)
        assert isinstance(dataloader, DataLoader)  # describe_train_loader refused anything else
        data = self.for_members(data, members)
        self._set_accumulation(trainer, data, cohort.rank)
        batch_size = data.rank_batch_size(cohort.rank)
        if cohort.data is None and cohort.resume is None and trainer.ckpt_path is not None:
            # A checkpoint written by another strategy (DDP, say): weights, optimizer and global_step carry over.
            cohort.adopt_steps(trainer.global_step, _lightning.logged_step(trainer))
            rank_zero_warn(
                f"ElChe: the checkpoint {trainer.ckpt_path} has no ElChe state (written by strategy='ddp'?). Weights, "
                "optimizer state and global_step are restored; if it was saved inside an epoch, that epoch restarts "
                "from its first sample, as it would under DDP."
            )
        cohort.set_train_data(data, lookahead)
        if (shared := shared_remote_chunks(dataloader.dataset, cohort.dynamic)) is not None:
            rank_zero_warn(f"ElChe: {shared}. Copying the dataset to local or shared storage avoids the downloads.")
        self.lanes = reading_lanes(dataloader, data, batch_size)
        self._sampler = sampler = ElCheSampler(cohort.begin_epoch, rank=cohort.rank, claiming=claiming())
        # Lightning creates (and prefetches from) the first iterator before it calls set_epoch. (Its type for
        # the fit loop's epoch tracker, a _ProcessedTracker, is the base class, which lacks `processed`.)
        sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
        return with_sampler(dataloader, data, sampler, batch_size)

    def _fit_samples(self, dataloader: object, cohort: "Cohort", world_size: int) -> Optional[int]:
        """The samples the fit trains, where ``max_steps`` gives them (the epoch of an endless stream): DDP's
        ``max_steps x world size x batch size x accumulate_grad_batches``, fixed when the fit starts, so a
        resume keeps its checkpoint's on any world size. None without ``max_steps``."""
        if cohort.resume is not None:
            return cohort.resume.num_samples
        batch_size = getattr(dataloader, "batch_size", None)
        max_steps = cohort.limits.max_steps  # the user's: the strategy judges it, Lightning's loop sees -1
        if max_steps < 0 or not batch_size:
            return None
        return max_steps * world_size * batch_size * self._user_accumulation

    def for_members(self, data: TrainData, members: Sequence[int]) -> TrainData:
        """``data`` with every rank's batch size for the cohort of these ``members`` (member ids in rank order)."""
        micro = self.settings.micro_batch_sizes
        if micro is None:
            return data
        if data.units is not None:
            raise ValueError(
                "ElCheStrategy(micro_batch_sizes=...) cuts each rank's batch into its own micro-batches, but the train "
                "DataLoader's batch_sampler makes the batches (its buckets, say), which ElChe hands out whole: a batch "
                "has no size to divide. Leave micro_batch_sizes=None, or make the batches smaller in the batch_sampler"
            )
        return dataclasses.replace(data, rank_batch_sizes=rank_batch_sizes(micro, members, data.batch_size, self.fixed))

    def _set_accumulation(self, trainer: "pl.Trainer", data: TrainData, rank: int) -> None:
        """This rank accumulates over as many batches as make the user's step (Lightning scales each batch's
        loss by ``accumulate_grad_batches``, so the accumulated gradient is the mean over the step's
        samples, as with the full batch). Micro-batches are refused with manual optimization and
        accumulation schedules."""
        if self.settings.micro_batch_sizes is not None:
            trainer.accumulate_grad_batches = self._user_accumulation * data.batch_size // data.rank_batch_size(rank)

    def rebind(self, cohort: "Cohort", claiming: Claiming) -> None:
        """The train sampler serves ``cohort`` (a new generation's) from the next iterator on."""
        if self._sampler is not None:
            self._sampler.rebind(cohort.begin_epoch, cohort.rank, claiming)

    def give_back(self, trainer: "pl.Trainer") -> None:
        """The Trainer's own ``accumulate_grad_batches`` again after the fit, where micro-batches changed it."""
        if self.settings.micro_batch_sizes is not None:
            trainer.accumulate_grad_batches = self._user_accumulation
