"""ElCheStrategy: data parallelism for ranks of unequal speed, as a Lightning strategy.

A :class:`~lightning.pytorch.strategies.DDPStrategy` without the DistributedDataParallel wrapper:
launcher, process group, cluster environments, barriers and the evaluation loops are DDP's.
What changes is training: each rank steps its own optimizer on its own share of the data, and
every window the ranks replace their parameters with a work-weighted average. This module is
the Lightning lifecycle only; each hook hands its work to one collaborator:

- the membership mode (``world.py``: fixed, or ``elastic.py``), chosen once from the settings;
- the fit's session (``session.py``): the cohort core, the averager, liveness and claims, per generation;
- the checkpoints (``checkpoints.py``) and the guarded collectives (``collectives.py``);
- the controller callback (``callback.py``), which runs the boundaries.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.records import BoundaryRecord
from lightning_elche.comm.groups import (
    broadcast_module_states,
    destroy_process_group_at_exit,
    init_process_group_for_restart,
    restart_attempt,
)
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.callback import ElCheCallback
from lightning_elche.lightning.checkpoints import CohortCheckpoints
from lightning_elche.lightning.collectives import GuardedCollectives
from lightning_elche.lightning.compatibility import check_fit_configuration
from lightning_elche.lightning.elastic import ElasticWorld
from lightning_elche.lightning.elastic_launch import ElasticEnvironment
from lightning_elche.lightning.session import FitSession
from lightning_elche.lightning.settings import (
    REDUCE_ON,
    Averaging,
    Data,
    ElCheSettings,
    Faults,
    Links,
    Reporting,
    Window,
)
from lightning_elche.lightning.takeover import TrainerTakeover
from lightning_elche.lightning.warm_launch import WarmScriptLauncher
from lightning_elche.lightning.warm_start import import_zygote
from lightning_elche.lightning.world import FixedWorld, GroupHost, World


class ElCheStrategy(DDPStrategy):
    """Cadence-driven, work-weighted parameter averaging for data-parallel training on mixed hardware.

    Settings come in six groups (``lightning_elche.Window``, ``Averaging``, ``Data``, ``Faults``,
    ``Links``, ``Reporting``: docs/configuration.md), and the ones most projects set are arguments of
    their own. Any setting of a group may also be given by its name (``ElCheStrategy(anchor=4)`` is
    ``ElCheStrategy(window=Window(anchor=4))``); ``trainer.strategy.settings`` holds them all, checked.

    Args:
        policy: ``"cadence"`` (default) gives faster ranks proportionally more steps and data per
            window and tunes the window to ``overhead_target``; ``"sync"`` averages after every
            optimizer step with equal shares (mathematically DDP with plain SGD); ``"async"`` is
            cadence with the parameter all-reduce running while the next window trains, its average
            applied one window late (consensus again before validation, checkpoints and stops).
        overhead_target: fraction of a window the boundary may cost, in [0.01, 0.5] (0.05).
        dispatch: how a window's samples reach the ranks. ``"dynamic"``: each rank claims its next
            step's samples from the window's pool (an atomic counter in the rendezvous store), so
            when speeds change or jitter nobody waits much more than one step at a boundary;
            ``"planned"``: each rank gets a share decided a window ahead from its measured speed;
            ``"auto"`` (default): dynamic, unless the shares are fixed (policy "sync",
            ``partition_ratios``, ``max_batch_diff``), the module optimizes manually or there is one rank.
        elastic: when a rank dies or stalls, the others go on without it from the next boundary
            instead of stopping (launch with ``python -m lightning_elche.launch``; docs/elastic.md).
        compression: for slow links (docs/slow-links.md): send each rank's change since the last
            consensus as ``"bf16"``, ``"int8"`` or ``"fp8"`` (block-scaled), with error feedback.
        outer_optimizer: an :class:`~lightning_elche.OuterNesterov` to step the global model on
            the pseudo-gradient (DiLoCo) instead of taking the plain average at every boundary;
            ``"none"``: plain averaging; ``"auto"`` (default): DiLoCo's step at boundaries where the
            members' speeds differ 1.5x or more, plain averaging where they do not (docs/choosing.md).
        timeout: process-group timeout; a rank that stops answering fails the others after this
            long instead of torch's 30 minutes (default 5 minutes; timedelta or seconds, 1 s to 7 days).
        window: a :class:`~lightning_elche.Window` (how long windows are, and the guard).
        averaging: an :class:`~lightning_elche.Averaging` (what a boundary does with the replicas).
        data: a :class:`~lightning_elche.Data` (how the epoch's samples reach the ranks).
        faults: a :class:`~lightning_elche.Faults` (what a lost rank does to the fit).
        links: a :class:`~lightning_elche.Links` (slow links).
        reporting: a :class:`~lightning_elche.Reporting` (metrics rolled up across ranks).
        **settings: any other setting of a group, by its name.

    The remaining arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.
    """

    strategy_name = "elche"

    def __init__(
        self,
        policy: Optional[Literal["sync", "cadence", "async"]] = None,
        overhead_target: Optional[float] = None,
        dispatch: Optional[Literal["auto", "planned", "dynamic"]] = None,
        elastic: Optional[bool] = None,
        compression: Optional[Literal["bf16", "int8", "fp8"]] = None,
        outer_optimizer: Union[OuterNesterov, Literal["auto", "none"], None] = None,
        timeout: Union[timedelta, float, None] = None,
        *,
        window: Optional[Window] = None,
        averaging: Optional[Averaging] = None,
        data: Optional[Data] = None,
        faults: Optional[Faults] = None,
        links: Optional[Links] = None,
        reporting: Optional[Reporting] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **settings: Any,
    ) -> None:
        given = {"policy": policy, "overhead_target": overhead_target, "dispatch": dispatch, "elastic": elastic,
                 "compression": compression, "outer_optimizer": outer_optimizer, "timeout": timeout}  # fmt: skip
        flat = {name: value for name, value in given.items() if value is not None}
        flat.update(_without_deprecated(settings))
        groups = {"window": window, "averaging": averaging, "data": data, "faults": faults, "links": links,
                  "reporting": reporting}  # fmt: skip
        self.settings = ElCheSettings.from_arguments(groups, flat)
        self.world: World = ElasticWorld(self.settings.timeout) if self.settings.faults.elastic else FixedWorld(
            self.settings.timeout.total_seconds()
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"ElCheStrategy: `start_method` must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}")
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise ValueError(
                "ElCheStrategy: `process_group_backend` must be a backend name such as 'gloo' or 'nccl', "
                f"got {process_group_backend!r}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=self.world.cluster_environment(cluster_environment),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.settings.timeout,
            start_method=start_method,
        )
        self.session: Optional[FitSession] = None  # the fit in progress
        self.checkpoints = CohortCheckpoints(self, self.settings)
        self.collectives = GuardedCollectives(self, self.settings.faults.strict_collectives)
        self.callback = ElCheCallback(self)  # put first in the trainer's callbacks on connect
        self._last_cohort: Optional[Cohort] = None  # the last fit's, kept for its history
        self._estimating_stepping_batches = False

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

    # ------------------------------------------------------------------ process group

    @override
    def _configure_launcher(self) -> None:
        """DDP's launcher; for ``start_method="popen"`` with the ranks forked warm where this process
        made a zygote as it imported lightning_elche (``warm_launch.py``)."""
        super()._configure_launcher()
        zygote = import_zygote()
        if self._start_method == "popen" and zygote is not None:
            assert self.cluster_environment is not None
            self._launcher = WarmScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes, zygote)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()  # Lightning does so only for NCCL

    @override
    def setup_distributed(self) -> None:
        self.world.setup_distributed(GroupHost(
            setup_launched_group=self._setup_launched_group, backend=self._backend,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
            place_rank=self._place_rank, move_to_slot=self._move_to_slot,
        ))  # fmt: skip

    def _setup_launched_group(self) -> None:
        """DDP's setup, except under a torchrun restart: its agent keeps one rendezvous store across
        restarts, so the relaunched ranks would read the dead ones' gloo/NCCL addresses and fail to
        connect (pytorch/pytorch#167288). Each attempt gets its own key prefix instead."""
        attempt = restart_attempt()
        if attempt is None:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_process_group_for_restart(self.cluster_environment, self._backend(), attempt, self.settings.timeout, device_id)

    def _backend(self) -> str:
        self._process_group_backend = self._get_process_group_backend()
        return self._process_group_backend

    def _place_rank(self, rank: int, world_size: int) -> None:
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(rank)
        self.cluster_environment.set_world_size(world_size)
        _lightning.set_rank_zero(rank)

    def _move_to_slot(self, slot: int) -> None:
        assert isinstance(self.cluster_environment, ElasticEnvironment) and self.accelerator is not None
        self.cluster_environment.set_local_rank(slot)
        self.accelerator.setup_device(self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self.world.sampler_kwargs(super().distributed_sampler_kwargs, self.global_rank, self.world_size)

    # ------------------------------------------------------------------ the fit

    @override
    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        trainer = _lightning.module_trainer(model)
        callbacks = None if trainer is None else _lightning.connector_attributes(trainer).callbacks
        if callbacks is not None and self.callback not in callbacks:
            callbacks.insert(0, self.callback)

    @property
    def fitting(self) -> bool:
        """Whether ``trainer.fit`` is under way (its set-up included): a rank lost outside one is not survived."""
        module = self.lightning_module
        trainer = None if module is None else _lightning.module_trainer(module)
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_fit_configuration(trainer, self, self.settings)
        self._estimating_stepping_batches = fitting
        try:
            super().setup(trainer)
        finally:
            self._estimating_stepping_batches = False
        if fitting:
            self._begin_fit(trainer)

    def _begin_fit(self, trainer: "pl.Trainer") -> None:
        """The fit's session: the Trainer's per-rank settings taken over, the cohort started (resumed from
        the checkpoint's ElChe state, if any), signals recorded for the next boundary."""
        _lightning.discard_train_dataloader(trainer)
        self.world.before_fit(trainer, self.checkpoints)
        takeover = TrainerTakeover(trainer, self.lr_scheduler_configs)
        self.session = session = FitSession(trainer, self, self.settings, takeover, self.world)
        resume = self.checkpoints.resume
        cohort = session.begin(resume)
        outer = self.settings.outer_optimizer
        if outer is not None and resume is not None and resume.outer is not None:
            outer.load_state_dict(resume.outer)  # after the averager bound it
        averager_states = self.checkpoints.averager_states()
        if averager_states:
            session.averager.load_state_dicts(averager_states)
        # the session's cohort when the signal comes: an elastic fit has one per generation
        takeover.handle_signals(lambda signum: session.cohort.requests.received_sigterm(),
                                lambda signum: session.cohort.requests.received_requeue(signum))  # fmt: skip
        takeover.follow_lr_schedules(cohort.automatic_optimization, cohort.cohort_step)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None  # Lightning loads the train loader of a connected module
        trainer = self.lightning_module.trainer
        validating = trainer.state.stage in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING)
        if validating and trainer.state.fn == TrainerFn.FITTING and self.session is not None:
            return self.world.validation_loader(dataloader, self.session, whole_set=trainer.limit_val_batches == 1.0)
        if trainer.state.stage != RunningStage.TRAINING or self._estimating_stepping_batches:
            # `estimated_stepping_batches` in configure_optimizers (OneCycleLR's usual set-up) loads
            # the train loader before ElChe can plan an epoch: it sees DDP's sampler, hence DDP's
            # step count, which is also the DDP-equivalent global_step the schedule will follow.
            return dataloader
        session = self.session
        assert session is not None  # set up in `setup` when fitting
        return session.dispatch.train_loader(dataloader, trainer, session.cohort, session.claiming, session.members())

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel: replicas train independently and meet at boundaries (a rank joining
        an elastic fit receives the consensus from rank 0 instead)."""
        if not self.world.joining:
            model = self.model
            assert model is not None  # connected before the fit's setup
            self.collectives.run("a broadcast of rank 0's initial weights", lambda: broadcast_module_states(model))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.session is not None:
            self.session.cohort.optimizer_stepped()
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave this rank's error in the rendezvous store: the other ranks, who only see it stop
        answering, quote it when they name it."""
        super().on_exception(exception)
        if self.session is not None and self.session.liveness is not None:
            self.session.liveness.failed(exception)

    @override
    def teardown(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.takeover.give_back()
            session.dispatch.give_back(session.trainer)
            session.cohort.fit_ended()
            self._last_cohort = session.cohort
            self.world.fit_ends(self.global_rank)
        self.checkpoints.forget_resume()
        super().teardown()

    # ------------------------------------------------------------------ collectives and checkpoints

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        # a joiner's set-up checks (a loader's length on every rank) get this rank's own answer
        return self.collectives.run(
            "a reduce (`self.log(..., sync_dist=True)` with on_step=True?)",
            lambda: super(ElCheStrategy, self).reduce(tensor, group=group, reduce_op=reduce_op), alone=lambda: tensor,
        )

    @override
    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        return self.collectives.run(
            "an all_gather (`self.all_gather`?)",
            lambda: super(ElCheStrategy, self).all_gather(tensor, group=group, sync_grads=sync_grads),
        )

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # the members are mid-fit: a joiner's set-up (a checkpoint folder, say) is its own
        return self.collectives.run(
            "a broadcast", lambda: super(ElCheStrategy, self).broadcast(obj, src), alone=lambda: obj
        )

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.collectives.run(
            "a barrier (`trainer.save_checkpoint`?)", lambda: super(ElCheStrategy, self).barrier(*args, **kwargs),
            alone=lambda: None,
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.collectives.check("a checkpoint save (`trainer.save_checkpoint`?)")
        self.checkpoints.save(checkpoint, filepath, lambda content: super(ElCheStrategy, self).save_checkpoint(
            content, filepath, storage_options=storage_options))  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.checkpoints.load(checkpoint_path, weights_only, lambda path, only: super(
            ElCheStrategy, self).load_checkpoint(path, weights_only=only))  # fmt: skip

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.checkpoints.remove_parts(filepath)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(self.checkpoints.optimizer_states(checkpoint))

    # ------------------------------------------------------------------ what users read

    @property
    def cohort(self) -> Optional[Cohort]:
        """The cohort core of the fit in progress (or of the last fit, for its history)."""
        return self.session.cohort if self.session is not None else self._last_cohort

    @property
    def cohort_step(self) -> int:
        """The DDP-equivalent step: total optimizer steps of all ranks divided by the world size."""
        return self.cohort.cohort_step if self.cohort is not None else 0

    @property
    def cohort_steps_total(self) -> int:
        """All ranks' optimizer steps (``global_step × world_size`` up to the remainder)."""
        return self.cohort.cohort_steps_total if self.cohort is not None else 0

    @property
    def boundaries(self) -> list[BoundaryRecord]:
        """Every boundary of the current (or last) fit, in order (see :class:`~lightning_elche.BoundaryRecord`)."""
        return self.cohort.history if self.cohort is not None else []


def _without_deprecated(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` by name, with ``backend``, ``reduce_on``'s deprecated name, turned into it (easily taken
    for DDP's ``process_group_backend``, so a process-group backend name there is refused pointing to it)."""
    settings = dict(settings)
    backend = settings.pop("backend", None)
    if backend is None:
        return settings
    if backend not in REDUCE_ON:
        raise ValueError(
            f"ElCheStrategy: `backend`={backend!r} is not a process-group backend: it was where the boundary "
            f"reduces, now `reduce_on` ('device' or 'cpu'). For the process group's backend (gloo, nccl) "
            f"use `process_group_backend`={backend!r}"
        )
    if settings.get("reduce_on", "device") != "device":
        raise ValueError("ElCheStrategy: give `reduce_on` only; `backend` is its deprecated name")
    rank_zero_deprecation(
        f"ElCheStrategy(backend={backend!r}) is deprecated and will be removed in 0.3: use reduce_on={backend!r}"
    )
    return {**settings, "reduce_on": backend}
