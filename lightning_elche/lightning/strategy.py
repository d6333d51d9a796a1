"""ElCheStrategy: data parallelism for ranks of unequal speed, as a Lightning strategy.

A :class:`~lightning.pytorch.strategies.DDPStrategy` without the DistributedDataParallel wrapper:
launcher, process group, cluster environments, barriers and the evaluation loops are DDP's.
What changes is training: each rank steps its own optimizer on its own share of the data, and
every window the ranks replace their parameters with a work-weighted average. This module is
the Lightning lifecycle only: the cohort core (``cohort/core.py``) decides, ``comm/`` moves the
bytes, the callback (``callback.py``) runs the boundaries.
"""

from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.guards import ConvergenceGuard
from lightning_elche.cohort.records import BoundaryRecord, user_field
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.averaging import Averager, make_averager
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.comm.compressed import CompressedAverager
from lightning_elche.comm.groups import (
    boundary_group,
    broadcast_module_states,
    destroy_process_group_at_exit,
    init_process_group_for_restart,
    restart_attempt,
)
from lightning_elche.comm.liveness import Liveness
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.callback import ElCheCallback
from lightning_elche.lightning.checkpoints import CohortCheckpoints
from lightning_elche.lightning.collectives import CohortCollectives
from lightning_elche.lightning.compatibility import check_fit_configuration
from lightning_elche.lightning.dispatch import CohortDispatch
from lightning_elche.lightning.elastic import ElasticCohort, ElasticEnvironment
from lightning_elche.lightning.schedulers import CohortScheduler, unwrap_schedulers, wrap_step_schedulers
from lightning_elche.lightning.settings import DEFAULT_TIMEOUT, ElCheSettings, MicroBatchSizes
from lightning_elche.sim.slowdown import SlowLink

_FIT_NUMBERS = itertools.count(1)  # the same sequence on every rank: keys of one fit never meet another's


def _setting(name: str, cohort: bool = True) -> Any:
    """A property over the checked argument ``name`` (typed Any: ``host.py`` declares what the mixins read)."""
    return property(
        lambda self: getattr(self.settings.cohort if cohort else self.settings, name), doc=f"The checked ``{name}`` argument."
    )


class ElCheStrategy(ElasticCohort, CohortDispatch, CohortCheckpoints, CohortCollectives, DDPStrategy):
    """Cadence-driven, work-weighted parameter averaging for data-parallel training on mixed hardware.

    Args:
        policy: ``"cadence"`` (default) gives faster ranks proportionally more steps and data per
            window and tunes the window to ``overhead_target``; ``"sync"`` averages after every
            optimizer step with equal shares (mathematically DDP with plain SGD); ``"async"`` is
            cadence with the parameter all-reduce running while the next window trains, its average
            applied one window late (consensus again before validation, checkpoints and stops).
        reduce_on: where the boundary reduces: ``"device"`` on the model's device (NCCL on GPUs,
            gloo on CPU); ``"cpu"`` stages through host memory and reduces over gloo, for rigs
            without NCCL peer-to-peer. (``backend``: its deprecated name.)
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
        dispatch: how a window's samples reach the ranks. ``"dynamic"``: each rank claims its next
            step's samples from the window's pool (an atomic counter in the rendezvous store), so
            when speeds change or jitter nobody waits much more than one step at a boundary
            (docs/how-it-works.md); automatic optimization, policy cadence or async. ``"planned"``:
            each rank gets a share decided a window ahead from its measured speed. ``"auto"``
            (default): dynamic, unless ``policy="sync"``, ``partition_ratios`` or
            ``max_batch_diff`` fix the shares, the module optimizes manually or there is one rank.
        seed: seed of the per-epoch sample permutation (default: Lightning's
            ``DistributedSampler`` seed, i.e. ``seed_everything``'s).
        strict_collectives: raise a clear error when a collective (``self.log(..., sync_dist=True)``
            per step, ``self.all_gather``, a barrier) is issued inside a training batch outside a
            boundary, where ranks run different numbers of batches and it would deadlock.
        timeout: process-group timeout; a rank that stops answering fails the others after this
            long instead of torch's 30 minutes (default 5 minutes; timedelta or seconds, 1 s to 7 days).
        elastic: when a rank dies or stalls, the others go on without it from the next boundary
            instead of stopping (launch with ``python -m lightning_elche.launch``; docs/elastic.md).
        compression: for slow links (docs/slow-links.md): send each rank's change since the last
            consensus as ``"bf16"``, ``"int8"`` or ``"fp8"`` (block-scaled), with error feedback,
            instead of full-precision parameters (None, the default).
        fragments: average the parameters in this many fragments of whole tensors, one per boundary
            in turn (every one where a consensus is needed); 1 (default): all at every boundary.
        link_mbit_s: the slowest link's bandwidth, if known: the anchor is then sized for it from
            the first window instead of growing toward it.
        simulated_link: a :class:`~lightning_elche.SlowLink` that slows every boundary collective to a
            simulated link (benchmarks, tests).
        micro_batch_sizes: for ranks with less memory: each rank's batch size, a list in rank order
            or a mapping {global rank: size}, each dividing the train DataLoader's ``batch_size``; a
            rank with a smaller one accumulates gradients over more batches, so every optimizer step
            still sees ``batch_size`` x ``accumulate_grad_batches`` samples (docs/configuration.md).

    The remaining arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.
    """

    strategy_name = "elche"

    def __init__(
        self,
        policy: Literal["sync", "cadence", "async"] = "cadence",
        reduce_on: Literal["device", "cpu"] = "device",
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
        dispatch: Literal["auto", "planned", "dynamic"] = "auto",
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        strict_collectives: bool = True,
        elastic: bool = False,
        compression: Optional[Literal["bf16", "int8", "fp8"]] = None,
        fragments: int = 1,
        link_mbit_s: Optional[float] = None,
        simulated_link: Optional[SlowLink] = None,
        micro_batch_sizes: Optional[MicroBatchSizes] = None,
        backend: Optional[Literal["device", "cpu"]] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.settings = ElCheSettings.from_arguments(
            policy=policy, reduce_on=reduce_on, backend=backend, anchor=anchor, min_anchor=min_anchor, max_anchor=max_anchor,
            overhead_target=overhead_target, max_batch_diff=max_batch_diff, partition_ratios=partition_ratios,
            gamma=gamma, guard=guard, divergence_threshold=divergence_threshold, outer_optimizer=outer_optimizer,
            easgd_alpha=easgd_alpha, scalar_reductions=scalar_reductions, node_sync_every=node_sync_every,
            ranks_per_node=ranks_per_node, seed=seed, dispatch=dispatch, timeout=timeout,
            strict_collectives=strict_collectives, elastic=elastic, compression=compression, fragments=fragments,
            link_mbit_s=link_mbit_s, simulated_link=simulated_link, micro_batch_sizes=micro_batch_sizes,
            process_group_backend=process_group_backend, start_method=start_method,
        )  # fmt: skip
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=ElasticEnvironment() if elastic and cluster_environment is None else cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.settings.timeout,
            start_method=start_method,
        )
        self.cohort: Optional[Cohort] = None  # the fit's cohort core; kept after the fit for its history
        self.averager: Optional[Averager] = None
        self.liveness: Optional[Liveness] = None
        self._claims: Optional[TicketCounter] = None  # dynamic dispatch's counter in the store
        self._callback: Optional[ElCheCallback] = None
        self._cohort_schedulers: list[CohortScheduler] = []
        self._fitting_trainer: Optional["pl.Trainer"] = None
        self._resume: Optional[ResumePoint] = None  # loaded with the checkpoint, handed to the fit's cohort
        self._estimating_stepping_batches = False

    policy = _setting("policy")
    anchor = _setting("anchor")
    min_anchor = _setting("min_anchor")
    max_anchor = _setting("max_anchor")
    overhead_target = _setting("overhead_target")
    max_batch_diff = _setting("max_batch_diff")
    partition_ratios = _setting("partition_ratios")
    gamma = _setting("gamma")
    guard = _setting("guard")
    divergence_threshold = _setting("divergence_threshold")
    easgd_alpha = _setting("easgd_alpha")
    scalar_reductions = _setting("scalar_reductions")
    node_sync_every = _setting("node_sync_every")
    ranks_per_node = _setting("ranks_per_node")
    seed = _setting("seed")
    dispatch = _setting("dispatch")

    reduce_on = _setting("reduce_on", cohort=False)
    outer_optimizer = _setting("outer_optimizer", cohort=False)
    strict_collectives = _setting("strict_collectives", cohort=False)
    micro_batch_sizes = _setting("micro_batch_sizes", cohort=False)

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        pairs = (("elche", "popen"), ("elche_spawn", "spawn"), ("elche_fork", "fork"), ("elche_notebook", "fork"))
        for name, start_method in pairs:
            strategy_registry.register(
                name, cls, description=f"ElChe cadence averaging for uneven ranks with `start_method` '{start_method}'",
                override=True, start_method=start_method,
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
        if self.settings.elastic:
            self._enter_first_generation()
            return
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

    @override
    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        callbacks = None if model._trainer is None else _lightning.connector_attributes(model._trainer).callbacks
        if callbacks is not None and self.callback not in callbacks:
            callbacks.insert(0, self.callback)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_fit_configuration(trainer, self, self.partition_ratios)
            if _lightning.connector_attributes(trainer).fast_dev_run:
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
        if self._joining:
            self._receive_state(trainer)
        elif self.membership is not None:
            self.share_logger_versions(trainer)
        self._fit_prefix = f"elche/fit{next(_FIT_NUMBERS)}"  # the same on every rank: each counts the same fits
        cohort = self._start_cohort(trainer, self._resume)
        # Until this fit writes one, the checkpoint it resumed from is the one a restart would use.
        cohort.last_checkpoint_path = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        if self.outer_optimizer is not None and self._resume is not None and self._resume.outer is not None:
            self.outer_optimizer.load_state_dict(self._resume.outer)  # after the averager bound it
        if isinstance(self.averager, CompressedAverager) and self._resume is not None and self._resume.averager_states:
            self.averager.load_state_dicts(self._resume.averager_states)

        def current() -> Cohort:  # self.cohort when the signal comes: an elastic fit has one per generation
            assert self.cohort is not None  # set above, never unset
            return self.cohort

        _lightning.install_sigterm_patches(
            trainer, lambda signum: current().sigterm_received(), lambda signum: current().requeue_requested(signum)
        )
        if cohort.automatic_optimization:
            self._cohort_schedulers = wrap_step_schedulers(self.lr_scheduler_configs, cohort.cohort_step)
        self._fitting_trainer = trainer

    def _start_cohort(self, trainer: "pl.Trainer", resume: Optional[ResumePoint], previous: Optional[Cohort] = None) -> Cohort:
        """The cohort core, averager, liveness marks and claim counter of this fit for the current world;
        again after each membership change of an elastic fit (``previous``: the last generation's
        cohort, which took over Lightning's step limits), on key prefixes of the generation's own."""
        settings, module = self.settings.cohort, self.lightning_module
        assert module is not None  # connected before the fit's setup
        callback = self.callback
        prefix = self._fit_prefix if self.membership is None else f"{self._fit_prefix}/g{self.membership.current.number}"
        self._claims = self._claim_counter(f"{prefix}/claims", module.automatic_optimization)
        scalar_reductions = settings.scalar_reductions or {}
        self.averager = averager = make_averager(
            module,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device if self.reduce_on == "device" else torch.device("cpu"),
            group=boundary_group(self.reduce_on, self._timeout),
            policy=settings.policy,
            gamma=settings.gamma,
            outer=self.outer_optimizer,
            easgd_alpha=settings.easgd_alpha,
            node_sync_every=settings.node_sync_every,
            ranks_per_node=settings.ranks_per_node or self.num_processes,
            extra_fields=[*(user_field(name) for name in scalar_reductions), *self.elastic_fields],
            compression=self.settings.compression,
            fragments=self.settings.fragments,
            link_delay=None if self.settings.simulated_link is None else self.settings.simulated_link.seconds,
        )
        self.cohort = cohort = Cohort(
            dataclasses.replace(
                settings.controller_config(self.world_size), boundary_bytes=averager.payload_bytes,
                link_mbit_s=self.settings.link_mbit_s, link_latency_ms=self.settings.link_latency_ms,
            ),
            settings.make_guard(),
            rank=self.global_rank,
            max_steps=_lightning.take_over_max_steps(trainer) if previous is None else previous.max_steps,
            min_steps=trainer.fit_loop.min_steps,
            automatic_optimization=module.automatic_optimization,
            step_checkpoint_every=(
                callback.take_over_step_checkpoints(trainer) if previous is None else previous.step_checkpoint_every
            ),
            time_limits_s=callback.take_over_step_timers(trainer) if previous is None else previous.time_limits_s,
            scalar_reductions=scalar_reductions,
            resume=resume,
            dispatch="planned" if self._claims is None else "dynamic",
            warn=rank_zero_warn,
        )
        self.liveness = Liveness.from_default_group(self.global_rank, self.world_size, prefix=prefix)
        return cohort

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel: replicas train independently and meet at boundaries (a rank joining
        an elastic fit receives the consensus from rank 0 instead)."""
        if not self._joining:
            assert self.model is not None  # connected before the fit's setup
            broadcast_module_states(self.model)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave this rank's error in the rendezvous store: the other ranks, who only see it stop
        answering, quote it when they name it."""
        super().on_exception(exception)
        if self.liveness is not None:
            self.liveness.failed(exception)

    @override
    def teardown(self) -> None:
        trainer, self._fitting_trainer = self._fitting_trainer, None
        if trainer is not None:
            _lightning.remove_sigterm_patches(trainer)
            if self.cohort is not None:
                _lightning.restore_max_steps(trainer, self.cohort.max_steps)
                self.cohort.in_window = False
            unwrap_schedulers(self.lr_scheduler_configs)
            self._cohort_schedulers = []
            self.callback.restore_step_checkpoints()
            self.callback.restore_step_timers()
            self.restore_accumulation(trainer)
        if self.membership is not None and trainer is not None and self.global_rank == 0:
            self.membership.finish()
        self.averager = None
        self._resume = None
        self.liveness = None
        self._claims = None
        super().teardown()

    # ------------------------------------------------------------------ steps

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.cohort is not None:
            self.cohort.optimizer_stepped()
        return output

    @property
    def cohort_step(self) -> int:
        """The DDP-equivalent step: total optimizer steps of all ranks divided by the world size."""
        return self.cohort.cohort_step if self.cohort is not None else 0

    @property
    def cohort_steps_total(self) -> int:
        """All ranks' optimizer steps (``global_step × world_size`` up to the remainder)."""
        return self.cohort.cohort_steps_total if self.cohort is not None else 0

    def follow_schedules(self, cohort_step: int) -> None:
        """Move step-interval LR schedulers to ``cohort_step`` (never back)."""
        for scheduler in self._cohort_schedulers:
            scheduler.follow(cohort_step)

    @property
    def boundaries(self) -> list[BoundaryRecord]:
        """Every boundary of the current (or last) fit, in order (see :class:`~lightning_elche.BoundaryRecord`)."""
        return self.cohort.history if self.cohort is not None else []
