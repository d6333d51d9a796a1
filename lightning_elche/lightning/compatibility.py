"""Trainer settings that cannot be made coherent when ranks run different numbers of batches.

Each of these either issues a collective per batch or decides something from a rank-local
clock or counter; with uneven ranks that deadlocks or silently mis-pairs collectives
(docs/compatibility.md says which, and why). They are refused when ``fit()`` starts, on every
rank, before any collective could diverge, with the setting named and what to use instead.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_elche.cohort.controller import partition_ratios_problem
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.settings import ElCheSettings


def _problems(trainer: "pl.Trainer", strategy: ParallelStrategy, settings: ElCheSettings) -> list[str]:
    problems = []
    if _lightning.layer_sync(strategy) is not None:
        problems.append(
            "`sync_batchnorm=True` all-gathers statistics in every forward; ElChe averages BatchNorm "
            "statistics at each boundary instead, so drop the flag"
        )
    ratios_problem = partition_ratios_problem(settings.data.partition_ratios, strategy.world_size)
    if ratios_problem is not None:
        problems.append(ratios_problem)
    if is_param_in_hook_signature(trainer.lightning_module.training_step, "dataloader_iter", explicit=True):
        problems.append(
            "`training_step(dataloader_iter)` fetches batches itself, so ElChe cannot close windows on batch "
            "boundaries; take `training_step(batch, batch_idx)`"
        )
    if settings.data.micro_batch_sizes is not None:
        problems.extend(_micro_batch_problems(trainer))
    for module in trainer.lightning_module.modules():
        if getattr(module, "dist_sync_on_step", False):
            problems.append(
                f"torchmetrics `{type(module).__name__}(dist_sync_on_step=True)` syncs every batch; "
                "log it per epoch (the default) instead"
            )
    return problems


def _micro_batch_problems(trainer: "pl.Trainer") -> list[str]:
    """``micro_batch_sizes`` sets each rank's ``accumulate_grad_batches``: Lightning's automatic
    optimization must do the accumulating, and nothing else may change it."""
    problems = []
    if not trainer.lightning_module.automatic_optimization:
        problems.append(
            "`micro_batch_sizes` accumulates a rank's smaller batches into a step, which only automatic "
            "optimization does; with manual optimization size the batches in your training_step instead"
        )
    callbacks = _lightning.connector_attributes(trainer).callbacks
    if any(isinstance(callback, GradientAccumulationScheduler) for callback in callbacks):
        problems.append(
            "`micro_batch_sizes` sets each rank's accumulate_grad_batches, which GradientAccumulationScheduler "
            "would change every epoch; use a fixed `accumulate_grad_batches` with it, or one of the two"
        )
    return problems


def check_fit_configuration(trainer: "pl.Trainer", strategy: ParallelStrategy, settings: ElCheSettings) -> None:
    """Raise one error listing every incoherent setting, on every rank, before training starts."""
    problems = _problems(trainer, strategy, settings)
    if problems:
        bullet_list = "\n".join(f"  - {p}" for p in problems)
        raise MisconfigurationException(
            "ElCheStrategy cannot train with these settings (ranks run different numbers of batches):\n"
            + bullet_list
        )
