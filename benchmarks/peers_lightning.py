"""The Lightning side of the peers benchmark: one process alone, Lightning DDP, Lightning's own
post-local SGD and ElChe's policies, each a fresh multi-process job on the same model and data.

``run(config, timeout)`` runs one configuration and returns each rank's report; rank 0 saves
copies of the cohort's model (``benchmarks.fashion.ModelCopies``) for scoring after the job, so
evaluation costs the training clock nothing. A copy is taken only where every rank holds the same
model: after any step under DDP or alone, after the periodic average under post-local SGD, after a
boundary under ElChe.

Post-local SGD is configured as Lightning documents it (``DDPStrategy(model_averaging_period=N)``
with ``post_localSGD_hook`` and a ``PostLocalSGDState``), with ``post_local_gradient_allreduce=False``
after the warm-up so that the ranks really train locally (the default all-reduces gradients within
each node every step, which on one machine is DDP). The hook is registered by :class:`CommHook`:
Lightning drops ``ddp_comm_hook`` on CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks.fashion import ModelCopies, load_data, repeated_loss, small_cnn, subset
from benchmarks.harness import run_job
from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, main_or_worker, write_report
from lightning_elche.sim.slowdown import Slowdown

MODULE = "benchmarks.peers_lightning"
POST_LOCAL_SGD_WARMUP_STEPS = 8  # global gradient all-reduce first, as Lightning's docs show


def strategy(name: str, period: int) -> Any:
    from lightning_elche import ElCheStrategy, OuterNesterov

    if name == "fast-alone":
        return "auto"
    if name == "ddp":
        return "ddp"
    if name == "post-local-sgd":  # its communication hook: ``comm_hooks(name)``
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(model_averaging_period=period)
    if name == "elche-cadence":
        return ElCheStrategy(timeout=120)
    if name == "elche-async":
        return ElCheStrategy(policy="async", timeout=120)
    if name == "elche-outer":
        return ElCheStrategy(outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9), timeout=120)
    raise ValueError(f"unknown Lightning configuration {name!r}")


class CommHook(pl.Callback):
    """Registers a DDP communication hook once Lightning has wrapped the model.

    ``DDPStrategy(ddp_comm_hook=...)`` is registered on CUDA devices only (Lightning 2.6,
    ``strategies/ddp.py``: ``_register_ddp_hooks``) and silently dropped on CPU, where post-local SGD
    then still all-reduces every gradient: DDP plus a periodic average. DDP's own
    ``register_comm_hook`` works on every backend.
    """

    def __init__(self, state: Any, hook: Callable[..., Any]) -> None:
        self.state, self.hook = state, hook

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        trainer.strategy.model.register_comm_hook(self.state, self.hook)


def comm_hooks(name: str) -> list[CommHook]:
    """Post-local SGD's hook (gradients all-reduced for the warm-up, then kept local) for its configuration."""
    if name != "post-local-sgd":
        return []
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD

    state = post_localSGD.PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=POST_LOCAL_SGD_WARMUP_STEPS, post_local_gradient_allreduce=False
    )
    return [CommHook(state, post_localSGD.post_localSGD_hook)]


class RepeatedClassifier(Classifier):
    """The slower rank of ``slowdown_model="arithmetic"``: k identical forward and backward passes."""

    def __init__(self, *args: Any, repeats: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.repeats = repeats

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return repeated_loss(self.net, x, y, self.repeats)


class ConsensusCopies(TrainClock):
    """The training clock, and on rank 0 a copy of the model wherever the ranks agree on it."""

    def __init__(self, copies: ModelCopies) -> None:
        super().__init__()
        self.copies = copies
        self.boundaries_seen = 0
        self.cohort_samples = 0
        self.boundary_ms: list[float] = []

    def now(self) -> float:
        import time

        return self.seconds + (time.perf_counter() - self._started if self._started is not None else 0.0)

    def _consensus(self, trainer: "pl.Trainer") -> bool:
        records = getattr(trainer.strategy, "boundaries", None)
        if records is not None:  # ElChe: only a boundary ends on one model
            new = records[self.boundaries_seen :]
            self.boundaries_seen = len(records)
            self.cohort_samples += sum(sum(r.samples) for r in new)
            self.boundary_ms += [min(r.previous_boundary_ms) for r in new if r.previous_boundary_ms]
            return bool(new)
        self.cohort_samples = self.samples * trainer.world_size
        averager = getattr(trainer.strategy, "_model_averager", None)
        if averager is None:  # DDP or alone: every step
            return True
        step = averager.step - 1  # the step whose optimizer step just ran (and maybe averaged)
        return step < averager.warmup_steps or (step - averager.warmup_steps) % averager.period == 0

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._consensus(trainer) and trainer.global_rank == 0:
            self.copies.offer(pl_module.net, self.now(), self.cohort_samples)


def worker(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(config["seed"], verbose=False)
    train = subset(load_data(config["data"])[0], config["train_samples"])
    factors = {int(rank): k for rank, k in config["factors"].items()}
    clock = ConsensusCopies(ModelCopies(config["eval_every_s"], config["budget_s"]))
    callbacks: list[Any] = [clock, *comm_hooks(config["name"])]
    arithmetic = config["slowdown_model"] == "arithmetic"
    if not arithmetic:
        callbacks.append(Slowdown(factors))
    trainer = pl.Trainer(
        devices=config["ranks"], strategy=strategy(config["name"], config["sync_every"]), max_epochs=config["epochs"],
        callbacks=callbacks, limit_val_batches=0, **QUIET_TRAINER,
    )
    net = small_cnn(train.tensors[0].shape[-1])
    repeats = int(factors.get(int(trainer.global_rank), 1.0)) if arithmetic else 1
    model = RepeatedClassifier(net, train, batch_size=config["batch_size"], lr=config["lr"], repeats=repeats)
    trainer.fit(model)
    if trainer.global_rank == 0 and config.get("snapshots"):
        clock.copies.finish(net, clock.seconds, clock.cohort_samples, config["snapshots"])
    write_report(config["out"], trainer.global_rank, {
        "seconds": clock.seconds, "samples": clock.samples, "boundaries": clock.boundaries_seen,
        "boundary_ms": clock.boundary_ms,
        "final_counts": trainer.strategy.boundaries[-1].counts if getattr(trainer.strategy, "boundaries", None) else None,
    })


def run(config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """The job's ranks: fresh interpreters, or (``config["warm"]``, a smoke run's) forked from this one, which
    has torch and Lightning imported already."""
    return run_job(MODULE, worker, config, config["ranks"], timeout, warm=bool(config.get("warm")))


if __name__ == "__main__":
    main_or_worker(lambda: None, worker)
