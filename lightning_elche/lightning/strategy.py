"""ElCheStrategy: data parallelism for ranks of unequal speed, as a Lightning strategy.

A :class:`~lightning.pytorch.strategies.DDPStrategy` without the DistributedDataParallel wrapper:
launcher, process group, cluster environments, barriers and the evaluation loops are DDP's.
What changes is training: each rank steps its own optimizer on its own share of the data, and
every window the ranks replace their parameters with a work-weighted average (see
``callback.py`` and ``averaging.py``). Only the Lightning glue lives here.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset
from typing_extensions import override

from lightning_elche.lightning import _lightning
from lightning_elche.comm import liveness
from lightning_elche.comm.averaging import Averager, make_averager
from lightning_elche.comm.groups import (
    boundary_group,
    broadcast_module_states,
    destroy_process_group_at_exit,
    gather_to_rank0,
    init_process_group_for_restart,
    restart_attempt,
)
from lightning_elche.lightning.callback import ElCheCallback
from lightning_elche.lightning.compatibility import check_fit_configuration
from lightning_elche.cohort.controller import Controller, ControllerConfig, split_by_weights
from lightning_elche.cohort.governor import AnchorGovernor
from lightning_elche.cohort.guards import ConvergenceGuard, make_guard
from lightning_elche.comm.liveness import FailurePlace, Liveness
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.cohort.plan import EpochPlan, TrainData, prefetch_depth
from lightning_elche.lightning.data import ElCheSampler
from lightning_elche.lightning.schedulers import CohortScheduler, unwrap_schedulers, wrap_step_schedulers
from lightning_elche.lightning.settings import DEFAULT_TIMEOUT, check_arguments
from lightning_elche.lightning.telemetry import user_field

_FIT_NUMBERS = itertools.count(1)  # the same sequence on every rank: keys of one fit never meet another's


class ElCheStrategy(DDPStrategy):
    """Cadence-driven, work-weighted parameter averaging for data-parallel training on mixed hardware.

    Args:
        policy: ``"cadence"`` (default) gives faster ranks proportionally more steps and data per
            window and tunes the window to ``overhead_target``; ``"sync"`` averages after every
            optimizer step with equal shares (mathematically DDP with plain SGD); ``"async"`` is
            cadence with the parameter all-reduce running while the next window trains, its average
            applied one window late (consensus again before validation, checkpoints and stops).
        backend: ``"device"`` reduces on the model's device (NCCL on GPUs, gloo on CPU);
            ``"cpu"`` stages through host memory and reduces over gloo, for rigs without NCCL
            peer-to-peer.
        anchor: optimizer steps per window of the slowest rank at the start (cadence: 10;
            sync: always 1).
        min_anchor: the overhead tuning never sets the anchor below this (default: ``anchor``).
        max_anchor: upper bound on the anchor, i.e. on staleness (default 1000).
        overhead_target: fraction of a window the boundary may cost, in [0.01, 0.5] (0.05).
        max_batch_diff: hard bound on how many more steps per window any rank may run than the
            slowest; None for no bound.
        partition_ratios: fixed per-rank shares (one positive number per rank) instead of
            measured speeds; the smallest marks the slow rank.
        gamma: averaging weight exponent, ``w_r = steps_r ** gamma`` (1.0: work-weighted,
            0.0: plain mean).
        guard: the convergence guard watching the replicas' divergence: ``"trend"`` (default),
            ``"msf"``, ``"none"`` or a :class:`~lightning_elche.cohort.guards.ConvergenceGuard`. It can
            hold the anchor's growth or shrink the anchor (see docs/how-it-works.md).
        divergence_threshold: divergence below which the named guard never acts (None: the
            guard's default, 0.05 for trend, 0.01 for msf).
        outer_optimizer: an :class:`~lightning_elche.OuterNesterov` to step the global model on
            the pseudo-gradient (DiLoCo) instead of taking the plain average (None, the default).
        easgd_alpha: with ``policy="async"``, how far each rank moves toward the late average
            (1.0: all the way; smaller: EASGD's elastic blend), in [0.01, 1].
        node_sync_every: hierarchical averaging: ranks of a node average every window, all ranks
            every ``node_sync_every`` windows (and wherever a consensus is needed), weighted by the
            work since the last global average. 1 (default): every boundary is global.
        ranks_per_node: how many consecutive ranks form a node for ``node_sync_every`` (default:
            Lightning's devices per node); set it to group ranks inside one machine.
        scalar_reductions: metrics your ``training_step`` logs per rank (``self.log(name, value)``,
            no ``sync_dist``) to roll up across ranks at every boundary, with ``"sum"``,
            ``"mean"``, ``"max"`` or ``"min"``, e.g. ``{"tokens": "sum", "peak_mem": "max"}``;
            logged from rank 0 as ``elche/user/<name>``, riding in the boundary's payload.
        seed: seed of the per-epoch sample permutation (default: Lightning's
            ``DistributedSampler`` seed, i.e. ``seed_everything``'s).
        strict_collectives: raise a clear error when a collective (``self.log(..., sync_dist=True)``
            per step, ``self.all_gather``, a barrier) is issued inside a training batch outside a
            boundary, where ranks run different numbers of batches and it would deadlock.
        timeout: process-group timeout; a rank that stops answering fails the others after this
            long instead of torch's 30 minutes (default 5 minutes; timedelta or seconds, 1 s to 7 days).

    The remaining arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.
    """

    strategy_name = "elche"

    def __init__(
        self,
        policy: Literal["sync", "cadence", "async"] = "cadence",
        backend: Literal["device", "cpu"] = "device",
        anchor: Optional[int] = None,
        min_anchor: Optional[int] = None,
        max_anchor: int = 1000,
        overhead_target: float = 0.05,
        max_batch_diff: Optional[int] = None,
        partition_ratios: Optional[Sequence[float]] = None,
        gamma: float = 1.0,
        guard: Union[str, ConvergenceGuard] = "trend",
        divergence_threshold: Optional[float] = None,
        outer_optimizer: Optional[OuterNesterov] = None,
        easgd_alpha: float = 1.0,
        scalar_reductions: Optional[dict[str, str]] = None,
        node_sync_every: int = 1,
        ranks_per_node: Optional[int] = None,
        seed: Optional[int] = None,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        strict_collectives: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        checked = check_arguments(
            policy=policy, backend=backend, anchor=anchor, min_anchor=min_anchor, max_anchor=max_anchor,
            overhead_target=overhead_target, max_batch_diff=max_batch_diff, partition_ratios=partition_ratios,
            gamma=gamma, guard=guard, divergence_threshold=divergence_threshold, outer_optimizer=outer_optimizer,
            easgd_alpha=easgd_alpha, scalar_reductions=scalar_reductions, node_sync_every=node_sync_every,
            ranks_per_node=ranks_per_node, seed=seed, timeout=timeout, strict_collectives=strict_collectives,
            process_group_backend=process_group_backend, start_method=start_method,
        )  # fmt: skip
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=checked.timeout,
            start_method=start_method,
        )
        self.policy = policy
        self.backend = backend
        self.anchor = checked.anchor
        self.min_anchor = checked.min_anchor
        self.max_anchor = int(max_anchor)
        self.overhead_target = float(overhead_target)
        self.max_batch_diff = None if max_batch_diff is None else int(max_batch_diff)
        self.partition_ratios = checked.partition_ratios
        self.gamma = float(gamma)
        self.guard = guard
        self.divergence_threshold = divergence_threshold
        self.governor: Optional[AnchorGovernor] = None
        self.outer_optimizer = outer_optimizer
        self.easgd_alpha = float(easgd_alpha)
        self.scalar_reductions = checked.scalar_reductions
        self.node_sync_every = int(node_sync_every)
        self.ranks_per_node = ranks_per_node
        self.seed = None if seed is None else int(seed)
        self.strict_collectives = strict_collectives
        self.collectives_blocked = False
        self._cohort_schedulers: list[CohortScheduler] = []
        self.controller: Optional[Controller] = None
        self.averager: Optional[Averager] = None
        self.plan: Optional[EpochPlan] = None
        self.lookahead_batches = prefetch_depth(0, None)
        self.cohort_steps_total = 0
        self.logged_steps_total = 0
        self.sigterm_pending = False
        self.requeue_signal: Optional[int] = None  # SLURM's requeue signal, waiting for the next boundary
        self.stop_requested = False
        self._window_steps = 0
        self._max_steps = -1
        self._callback: Optional[ElCheCallback] = None
        self._train_data: Optional[TrainData] = None
        self._fitting_trainer: Optional["pl.Trainer"] = None
        self._resume: Optional[ResumePoint] = None
        self._resume_checked = False
        self._estimating_stepping_batches = False
        self.last_checkpoint_path: Optional[str] = None
        self.liveness: Optional[Liveness] = None

    # ------------------------------------------------------------------ registry

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (
            ("elche", "popen"),
            ("elche_spawn", "spawn"),
            ("elche_fork", "fork"),
            ("elche_notebook", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"ElChe cadence averaging for uneven ranks with `start_method` '{start_method}'",
                override=True,
                start_method=start_method,
            )

    # ------------------------------------------------------------------ lifecycle

    @property
    def callback(self) -> ElCheCallback:
        """The controller callback that runs this strategy's boundaries (created on connect)."""
        if self._callback is None:
            self._callback = ElCheCallback(self)
        return self._callback

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()  # Lightning does so only for NCCL

    @override
    def setup_distributed(self) -> None:
        """DDP's setup, except under a torchrun restart: its agent keeps one rendezvous store across
        restarts, so the relaunched ranks would read the dead ones' gloo/NCCL addresses and fail to
        connect (pytorch/pytorch#167288). Each attempt gets its own key prefix instead."""
        attempt = restart_attempt()
        if attempt is None:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_process_group_for_restart(
            self.cluster_environment, self._process_group_backend, attempt, self._timeout, device_id
        )

    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        trainer = model._trainer
        if trainer is not None and self.callback not in trainer.callbacks:
            trainer.callbacks.insert(0, self.callback)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_fit_configuration(trainer, self)
            if trainer.fast_dev_run:
                # Lightning caps each rank at N batches; ElChe stops the cohort at N DDP-equivalent
                # steps instead (fast_dev_run also sets max_steps=N, taken over below).
                trainer.limit_train_batches = 1.0
        self._estimating_stepping_batches = fitting
        try:
            super().setup(trainer)
        finally:
            self._estimating_stepping_batches = False
        if not fitting:
            return
        _lightning.discard_train_dataloader(trainer)
        self.controller = Controller(
            ControllerConfig(
                world_size=self.world_size,
                policy=self.policy,
                anchor=self.anchor,
                min_anchor=self.min_anchor,
                max_anchor=self.max_anchor,
                overhead_target=self.overhead_target,
                max_batch_diff=self.max_batch_diff,
                partition_ratios=self.partition_ratios,
            )
        )
        self.averager = make_averager(
            self.lightning_module,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device if self.backend == "device" else torch.device("cpu"),
            group=boundary_group(self.backend, self._timeout),
            policy=self.policy,
            gamma=self.gamma,
            outer=self.outer_optimizer,
            easgd_alpha=self.easgd_alpha,
            node_sync_every=self.node_sync_every,
            ranks_per_node=self.ranks_per_node or self.num_processes,
            extra_fields=[user_field(key) for key in self.scalar_reductions],
        )
        self.cohort_steps_total = 0
        self.logged_steps_total = 0
        self.sigterm_pending = False
        self.requeue_signal = None
        self.stop_requested = False
        self._window_steps = 0
        self._max_steps = _lightning.take_over_max_steps(trainer)
        self._resume_checked = False
        # Until this fit writes one, the checkpoint it resumed from is the one a restart would use.
        self.last_checkpoint_path = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        self.liveness = Liveness.from_default_group(
            self.global_rank, self.world_size, prefix=f"elche/fit{next(_FIT_NUMBERS)}"
        )
        # A fresh guard per fit (an instance given by the user is copied, so a second fit starts clean).
        spec = self.guard if isinstance(self.guard, str) else copy.deepcopy(self.guard)
        self.governor = AnchorGovernor(make_guard(spec, self.divergence_threshold))
        if self._resume is not None:
            self.controller.load_state_dict(self._resume.controller)
            if self._resume.governor is not None:
                self._load_governor_state(self._resume.governor)
            if self.outer_optimizer is not None and self._resume.outer is not None:
                self.outer_optimizer.load_state_dict(self._resume.outer)
            self.cohort_steps_total, self.logged_steps_total = self._resume.totals_for(self.world_size)
        _lightning.install_sigterm_patches(trainer, self._on_sigterm, self._on_requeue_signal)
        if self.lightning_module.automatic_optimization:
            self._cohort_schedulers = wrap_step_schedulers(self.lr_scheduler_configs, self.cohort_step)
        self.callback.take_over_step_checkpoints(trainer)
        self.callback.take_over_step_timers(trainer)
        self._fitting_trainer = trainer

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel: replicas train independently and meet at boundaries."""
        broadcast_module_states(self.model)

    def teardown(self) -> None:
        trainer, self._fitting_trainer = self._fitting_trainer, None
        if trainer is not None:
            _lightning.remove_sigterm_patches(trainer)
            _lightning.restore_max_steps(trainer, self._max_steps)
            unwrap_schedulers(self.lr_scheduler_configs)
            self._cohort_schedulers = []
            self.callback.restore_step_checkpoints()
            self.callback.restore_step_timers()
            self.callback.restore_progress_bar()
        self.collectives_blocked = False
        self.averager = None
        self._resume = None
        self.liveness = None
        super().teardown()

    # ------------------------------------------------------------------ data

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or self._estimating_stepping_batches:
            # `estimated_stepping_batches` in configure_optimizers (OneCycleLR's usual set-up) loads
            # the train loader before ElChe can plan an epoch: it sees DDP's sampler, hence DDP's
            # step count, which is also the DDP-equivalent global_step the schedule will follow.
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"ElCheStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
            )
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError(
                "ElCheStrategy gives each rank a share of the training samples by index, which an IterableDataset "
                "does not have; use a map-style Dataset (with __getitem__ and __len__) for training, or strategy='ddp'"
            )
        if dataloader.batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
            raise ValueError(
                "ElCheStrategy needs the train DataLoader's `batch_size` (a custom `batch_sampler` cannot be split "
                "into windows); pass batch_size= to the DataLoader instead of a batch_sampler"
            )
        sampler = dataloader.sampler
        if type(sampler) is not DistributedSampler:
            raise ValueError(
                "ElCheStrategy partitions the training data itself and needs Lightning's DistributedSampler in "
                f"the train DataLoader, found {type(sampler).__name__}. Keep `Trainer(use_distributed_sampler=True)` "
                "and build the DataLoader with `shuffle=True/False` instead of a custom sampler."
            )
        self._train_data = TrainData(
            num_samples=len(sampler.dataset),  # type: ignore[arg-type]
            seed=sampler.seed if self.seed is None else self.seed,
            shuffle=sampler.shuffle,
            batch_size=dataloader.batch_size,
            samples_per_step=dataloader.batch_size * trainer.accumulate_grad_batches,
            drop_last=dataloader.drop_last,
        )
        self.lookahead_batches = prefetch_depth(dataloader.num_workers, dataloader.prefetch_factor)
        if not self._resume_checked:
            self._resume_checked = True
            self._check_resume(trainer, self._train_data)
        elche_sampler = ElCheSampler(self.begin_epoch, rank=self.global_rank)
        # Lightning creates (and prefetches from) the first iterator before it calls set_epoch.
        elche_sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        return _update_dataloader(dataloader, elche_sampler, mode=RunningStage.TRAINING)

    def begin_epoch(self, epoch: int) -> EpochPlan:
        """Build the epoch's plan from the replicated controller and freeze its first windows."""
        assert self._train_data is not None and self.controller is not None
        resumed = self._resume is not None and self._resume.epoch == epoch
        plan = self._train_data.plan(epoch, self.world_size, self._resume.covered if resumed else None)
        if resumed and plan.complete and not plan.sizes:
            # The checkpoint closed its epoch (saved at the last boundary or at validation): Lightning
            # moves on to the next epoch without creating another iterator, so this one serves it.
            plan = self._train_data.plan(epoch + 1, self.world_size)
        controller = self.controller
        controller.set_max_total_steps(len(plan.order) // self._train_data.samples_per_step)
        plan.freeze_ahead(0, self.lookahead_batches, lambda: self.next_window_steps(plan))
        self.plan = plan
        return plan

    def next_window_steps(self, plan: EpochPlan) -> list[int]:
        """The controller's counts for the next window to freeze, cut so that the cohort lands on ``max_steps``.

        Windows are frozen ahead of training, so what ``max_steps`` still allows is reduced by
        the steps of frozen windows not yet closed as well as by the steps already taken.
        """
        assert self.controller is not None
        counts = list(self.controller.counts)
        if self._max_steps < 0:
            return counts
        in_flight = plan.steps_from(self.callback.windows_closed(plan))
        allowed = self._max_steps * self.world_size - self.cohort_steps_total - in_flight
        if sum(counts) <= allowed:
            return counts
        return split_by_weights(max(allowed, self.world_size), counts, minimum=1)

    # ------------------------------------------------------------------ steps

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._window_steps += 1
        return output

    @property
    def window_steps(self) -> int:
        """Real optimizer steps this rank took since the last boundary."""
        return self._window_steps

    def take_window_steps(self) -> int:
        """Real optimizer steps this rank took since the last boundary; resets the count."""
        steps, self._window_steps = self._window_steps, 0
        return steps

    @property
    def cohort_step(self) -> int:
        """The DDP-equivalent step: total optimizer steps of all ranks divided by the world size."""
        return self.cohort_steps_total // self.world_size

    @property
    def logged_step(self) -> int:
        """The loggers' DDP-equivalent step: batches that stepped an optimizer, all ranks, over the world size."""
        return self.logged_steps_total // self.world_size

    def advance_cohort(self, steps: int) -> None:
        """Add a boundary's optimizer steps (all ranks) and bring step-interval LR schedulers to the exact step."""
        self.cohort_steps_total += steps
        self.follow_schedules(self.cohort_step)

    def follow_schedules(self, cohort_step: int) -> None:
        """Move step-interval LR schedulers to ``cohort_step`` (never back)."""
        for scheduler in self._cohort_schedulers:
            scheduler.follow(cohort_step)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        """ElChe's part of a checkpoint; Lightning's ``dump_checkpoint`` asks every rank at the same point."""
        plan, data, controller = self.plan, self._train_data, self.controller
        if plan is None or data is None or controller is None:
            return {}
        clock = self.callback.clock
        if self.collectives_blocked or (clock.plan is plan and clock.batches > 0):
            raise RuntimeError(
                f"ElChe checkpoints are taken at window boundaries, where every rank holds the consensus; rank "
                f"{self.global_rank} was asked to save inside window {clock.window} of epoch {plan.epoch}. Save from "
                "`on_train_epoch_end` or validation, or use ModelCheckpoint(every_n_train_steps=N), which ElChe "
                "moves to boundaries."
            )
        point = ResumePoint(
            epoch=plan.epoch,
            covered=plan.covered(self.callback.windows_closed(plan)),
            seed=data.seed,
            world_size=self.world_size,
            cohort_steps_total=self.cohort_steps_total,
            logged_steps_total=self.logged_steps_total,
            controller=controller.state_dict(),
            optimizer_states=self._gather_optimizer_states(),
            outer=None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
            governor=None if self.governor is None else self.governor.state_dict(),
        )
        return point.to_state()

    def _gather_optimizer_states(self) -> Optional[list[list[dict[str, Any]]]]:
        """Every rank's optimizer states, on rank 0 (which writes): each rank resumes its own trajectory."""
        states = [move_data_to_device(self.optimizer_state(opt), torch.device("cpu")) for opt in self.optimizers]
        group = boundary_group(self.backend, self._timeout)
        with self.naming_lost_ranks():
            return gather_to_rank0(states, self.global_rank, self.world_size, group)

    def _load_governor_state(self, state: dict[str, Any]) -> None:
        assert self.governor is not None
        try:
            self.governor.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as error:
            rank_zero_warn(
                f"ElChe: the checkpoint's convergence-guard state does not fit guard={self.guard!r} "
                f"({type(error).__name__}: {error}); the guard starts afresh"
            )

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ElChe state for the fit that resumes from it (callbacks load before ``setup``)."""
        self._resume = ResumePoint.from_state(state)

    def _check_resume(self, trainer: "pl.Trainer", data: TrainData) -> None:
        """Before the first resumed epoch is planned: the checkpoint must fit this training set."""
        resume = self._resume
        if resume is None:
            if trainer.ckpt_path is not None:
                self._resume_without_elche_state(trainer)
            return
        if resume.num_samples != data.num_samples:
            raise ValueError(
                f"the checkpoint {trainer.ckpt_path} was written while training on {resume.num_samples} samples, "
                f"but this train DataLoader has {data.num_samples}: ElChe cannot tell which samples of epoch "
                f"{resume.epoch} are left. Resume with the training set the checkpoint was made with, or load only "
                "the weights (`LightningModule.load_from_checkpoint`) and start a new fit."
            )
        if resume.seed != data.seed:
            rank_zero_warn(
                f"ElChe: the checkpoint was written with sampler seed {resume.seed}, this run uses {data.seed}: "
                f"the samples of epoch {resume.epoch} not trained yet are trained once, in seed {data.seed}'s order, "
                "and later epochs follow the new seed."
            )

    def _resume_without_elche_state(self, trainer: "pl.Trainer") -> None:
        """A checkpoint written by another strategy (DDP, say): weights, optimizer and global_step carry over."""
        self.cohort_steps_total = trainer.global_step * self.world_size
        self.logged_steps_total = _lightning.logged_step(trainer) * self.world_size
        rank_zero_warn(
            f"ElChe: the checkpoint {trainer.ckpt_path} has no ElChe state (written by strategy='ddp'?). Weights, "
            "optimizer state and global_step are restored; if it was saved inside an epoch, that epoch restarts "
            "from its first sample, as it would under DDP."
        )

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        own = self._resume.optimizer_states_for(self.global_rank) if self._resume is not None else None
        if own is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": own})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as exc:
            raise RuntimeError(
                f"ElChe cannot read the checkpoint {checkpoint_path} ({type(exc).__name__}: {exc}). It is truncated "
                "or corrupted, for instance by a job killed while writing it; resume from an earlier checkpoint."
            ) from exc

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.callback.state_key in checkpoint.get("callbacks", {}):
            self.last_checkpoint_path = str(filepath)  # a consensus checkpoint a restart can resume from

    # ------------------------------------------------------------------ collectives

    def _check_collective(self, what: str) -> None:
        if self.strict_collectives and self.collectives_blocked:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside a training batch. Under ElChe ranks run different numbers of "
                "batches, so a per-batch collective cannot be matched and would deadlock. Log per epoch instead "
                "(`self.log(..., on_step=False, on_epoch=True, sync_dist=True)`), or per step without "
                "`sync_dist`; move gathers to `on_train_epoch_end` or validation. "
                "`ElCheStrategy(strict_collectives=False)` turns this check off."
            )

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        self._check_collective("a reduce (`self.log(..., sync_dist=True)` with on_step=True?)")
        with self.naming_lost_ranks():
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        self._check_collective("an all_gather (`self.all_gather`?)")
        with self.naming_lost_ranks():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._check_collective("a broadcast")
        with self.naming_lost_ranks():
            return super().broadcast(obj, src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._check_collective("a barrier (`trainer.save_checkpoint`?)")
        with self.naming_lost_ranks():
            super().barrier(*args, **kwargs)

    def naming_lost_ranks(self) -> AbstractContextManager[None]:
        """Turn a collective that failed because ranks stopped answering into an error that names them
        (see :func:`lightning_elche.comm.liveness.naming_lost_ranks`)."""
        timeout_s = self._timeout.total_seconds()
        rank, world_size = self.global_rank, self.world_size
        return liveness.naming_lost_ranks(self.liveness, rank, world_size, timeout_s, self._failure_place)

    def _failure_place(self) -> FailurePlace:
        callback = self.callback
        return FailurePlace(
            boundary=len(callback.history),
            epoch=callback.clock.plan.epoch if callback.clock.plan is not None else -1,
            window=callback.clock.window,
            cohort_step=self.cohort_step,
            last_checkpoint=self.last_checkpoint_path,
        )

    def min_steps_met(self) -> bool:
        trainer = self._fitting_trainer
        min_steps = trainer.fit_loop.min_steps if trainer is not None else None
        return not min_steps or self.cohort_step >= min_steps

    def max_steps_reached(self) -> bool:
        return self.max_steps_would_be_reached(self.cohort_step)

    def max_steps_would_be_reached(self, cohort_step: int) -> bool:
        return self._max_steps >= 0 and cohort_step >= self._max_steps

    def release_max_steps(self, trainer: "pl.Trainer") -> None:
        """Hand ``max_steps`` back to Lightning once the cohort has reached it (every rank, same boundary).

        Lightning then ends the fit after this batch exactly as it does under DDP: no extra
        validation, the same checkpoints, ``min_steps`` long met.
        """
        _lightning.restore_max_steps(trainer, self._max_steps)

    def _on_sigterm(self, signum: int) -> None:
        self.sigterm_pending = True

    def _on_requeue_signal(self, signum: int) -> None:
        self.requeue_signal = signum

    @property
    def boundaries(self) -> list:
        """Every boundary of the current fit, in order (see :class:`~lightning_elche.lightning.callback.BoundaryRecord`)."""
        return self.callback.history
