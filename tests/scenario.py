"""A configurable multi-process training run for the tests.

Run as ``python tests/scenario.py '<json config>'``, the JSON of a
:class:`scenario_config.ScenarioConfig` (which says what each key does). Lightning's own launcher
(``devices=N``, start method popen) re-runs this script for ranks 1..N-1, exactly as it does for
users, over a real gloo process group. Every rank writes ``rank{r}.json`` into ``config.out`` with
what it observed: trained sample indices, boundaries, parameter digests after each boundary, every
torch.distributed call it issued, final parameters. The tests assert on those files.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from scenario_config import CollectiveFault, CollectiveOp, ScenarioConfig, thaw

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRACED = get_args(CollectiveOp)
DOOMED_DEATH_DEADLINE_S = 60.0  # how long a survivor of an "inside" collective fault waits for the doomed rank's death


class CollectiveTracer:
    """Records every torch.distributed collective with its origin and the training phase."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.phase = "setup"
        self.epoch = -1
        self.batch = -1
        self._depth = 0
        self.fault: CollectiveFault | None = None  # a rank dies at its nth matching collective
        self._matching = 0
        self.out: Path | None = None  # the scenario's output folder

    def install(self) -> None:
        for name in TRACED:
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.calls.append(
                    {
                        "op": name, "phase": self.phase, "epoch": self.epoch, "batch": self.batch, "origin": _origin(),
                        "group_size": _group_size(kwargs.get("group")),
                    }
                )
                if self.fault is not None:
                    self._inject_fault(name, self.calls[-1]["origin"])
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return traced

    def _inject_fault(self, name: str, origin: str) -> None:
        """The fault hook: at the nth collective matching ``op``, ``origin`` and ``phase`` (counted alike on
        every rank), the doomed rank is SIGKILLed right before entering it (``when: "before"``) or while it
        waits inside it (``"inside"``).

        "inside" is ordered by the events themselves, not by sleeping: the doomed rank notes its pid in
        ``fault.json`` and starts a timer that SIGKILLs it ``inside_s`` later, then enters the collective,
        which cannot complete without its peers; the survivors wait until that process is dead (see
        :func:`wait_for_death`) and only then enter. So the doomed rank dies blocked inside (or, were it
        starved of the CPU until its timer fired, before completing it), and the survivors certainly
        arrive after its death."""
        fault = self.fault
        assert fault is not None
        if name != fault.op or not origin.startswith(fault.origin):
            return
        if fault.phase is not None and fault.phase != self.phase:
            return
        self._matching += 1
        if self._matching != fault.nth:
            return
        if dist.get_rank() != fault.rank:
            if fault.when == "inside":
                wait_for_death(f"rank {fault.rank}, doomed inside {name} #{fault.nth}")
            return
        if fault.when == "inside":
            mark_fault(f"SIGKILL inside {name} #{fault.nth}", delay_s=fault.inside_s)
            threading.Timer(fault.inside_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            mark_fault(f"SIGKILL before {name} #{fault.nth}")
            os.kill(os.getpid(), signal.SIGKILL)


def die_joining_group(nth: int) -> None:
    """This member SIGKILLs itself as it starts to form its ``nth`` process group (every member of that
    generation said it was ready: the others are already waiting in the group's rendezvous)."""
    original = dist.init_process_group
    count = 0

    def dying_init(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count == nth:
            mark_fault(f"SIGKILL as it forms its process group #{nth}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    dist.init_process_group = dying_init


def die_at_admission() -> None:
    """This joiner SIGKILLs itself as it starts to receive the cohort's state at its admission (the members
    agreed on a generation with it, and rank 0 sends), unless another joiner of the fit did already
    (``<out>/died_at_admission``; kept apart from ``fault.json``, so that a fit can lose a member first)."""
    from lightning_elche.lightning import elastic

    receive = elastic.receive_from_rank0

    def dying_receive() -> Any:
        marker = Path(TRACER.out or ".") / "died_at_admission"
        try:
            marker.open("x").close()  # the first joiner here creates it; a later one finds it
        except FileExistsError:
            return receive()
        os.kill(os.getpid(), signal.SIGKILL)
        return None  # not reached

    elastic.receive_from_rank0 = dying_receive


def mark_fault(what: str, delay_s: float = 0.0) -> None:
    """Note in ``<out>/fault.json`` what a fault hook did, when (the tests time the survivors from it) and
    to which process. Written whole or not at all (a rank of :func:`wait_for_death` may be reading it)."""
    if TRACER.out is not None:
        TRACER.out.mkdir(parents=True, exist_ok=True)
        note = {"what": what, "time": time.time() + delay_s, "pid": os.getpid()}
        partial = TRACER.out / f"fault.json.{os.getpid()}"
        partial.write_text(json.dumps(note))
        os.replace(partial, TRACER.out / "fault.json")


def wait_for_death(what: str) -> None:
    """Return once the process that noted a fault in ``<out>/fault.json`` is dead (gone, or a zombie
    not yet reaped: its launcher may be the waiting rank itself); fail naming ``what`` if that has
    not happened within ``DOOMED_DEATH_DEADLINE_S``."""
    assert TRACER.out is not None
    deadline = time.monotonic() + DOOMED_DEATH_DEADLINE_S
    while time.monotonic() < deadline:
        note = TRACER.out / "fault.json"
        if note.exists() and not _alive(json.loads(note.read_text())["pid"]):
            return
        time.sleep(0.01)  # the poll's interval: the death itself is what ends the wait
    raise RuntimeError(
        f"scenario: {what}, was not dead {DOOMED_DEATH_DEADLINE_S:.0f} s after this rank reached that collective "
        f"(no fault noted in {TRACER.out / 'fault.json'}, or its process still alive)"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # "pid (comm) S ...": Z or X once it has died
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _group_size(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError):  # before the process group exists
        return -1


def _origin() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        # the wire (comm/link.py) only carries a collective: its origin is the module that asked for it
        if "lightning_elche" in filename and "tests" not in filename and Path(filename).stem != "link":
            return "elche:" + Path(filename).stem
        if f"{os.sep}lightning{os.sep}" in filename or "torchmetrics" in filename:
            return f"{Path(filename).parent.name}/{Path(filename).stem}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


TRACER = CollectiveTracer()
CRASH_EXIT_CODE = 17


class IndexedDataset(Dataset):
    """A fixed random regression/classification set whose items carry their own index."""

    def __init__(self, n: int, features: int = 8, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        weights = torch.randn(features, classes, generator=g)
        self.y = (self.x @ weights).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class IterableIndexedDataset(IterableDataset):
    """The same items as :class:`IndexedDataset`, streamed (no ``__getitem__``)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.items = IndexedDataset(n, seed=seed)

    def __iter__(self):
        return (self.items[i] for i in range(len(self.items)))

    def __len__(self) -> int:
        return len(self.items)


class IndexedShard:
    """Items ``[start, end)`` of an :class:`IndexedDataset`, readable only in order (a file of records),
    not knowing how many it holds (ElChe counts them)."""

    def __init__(self, items: IndexedDataset, start: int, end: int) -> None:
        self.items, self.start, self.end = items, start, end

    def __iter__(self):
        return (self.items[i] for i in range(self.start, self.end))


class SizedIndexedShard(IndexedShard):
    def __len__(self) -> int:
        return self.end - self.start


class ShardedIndexedDataset(IterableIndexedDataset):
    """The same items in shards of uneven sizes, following ElChe's sharded-iterable protocol."""

    SIZES = (37, 64, 50, 81, 23, 70)

    def __init__(self, n: int, seed: int = 0, sized: bool = True, one_shot_first: bool = False) -> None:
        super().__init__(n, seed)
        self.sized, self.one_shot_first = sized, one_shot_first

    def shards(self) -> list[IndexedShard]:
        shards, start, kind = [], 0, SizedIndexedShard if self.sized else IndexedShard
        while start < len(self.items):
            end = min(start + self.SIZES[len(shards) % len(self.SIZES)], len(self.items))
            shards.append(kind(self.items, start, end))
            start = end
        if self.one_shot_first:  # a generator: readable once, without len() (refused)
            shards[0] = iter(shards[0])  # type: ignore[call-overload]
        return shards


class EveryOtherSampler(Sampler):
    """A user-defined sampler (neither RandomSampler nor SequentialSampler): even indices first."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))

    def __len__(self) -> int:
        return self.n


class UserBatchSampler(BatchSampler):
    """A user's BatchSampler subclass (Lightning re-instantiates it around its own sampler)."""


def length_class(index: int) -> int:
    """The "length" of sample ``index`` for :class:`LengthBuckets`: three lengths, in turn every two indices,
    so that DDP's two ranks (every other index each) hold as many of each."""
    return index // 2 % 3


class LengthBuckets(BatchSampler):
    """Length bucketing, as speech and NLP projects batch: each batch holds samples of one length only (a
    bucket fills to ``batch_size``, the partial ones come last unless ``drop_last``), and the batches are
    shuffled with torch's generator. Under DDP Lightning re-makes it around each rank's DistributedSampler."""

    def _buckets(self) -> list[list[int]]:
        buckets: dict[int, list[int]] = {length: [] for length in range(3)}
        batches = []
        for index in self.sampler:
            bucket = buckets[length_class(index)]
            bucket.append(index)
            if len(bucket) == self.batch_size:
                batches.append(list(bucket))
                bucket.clear()
        return batches + [bucket for bucket in buckets.values() if bucket and not self.drop_last]

    def __iter__(self):
        batches = self._buckets()
        return iter([batches[i] for i in torch.randperm(len(batches)).tolist()])

    def __len__(self) -> int:
        return len(self._buckets())


def weighted_sampler(samples: int) -> WeightedRandomSampler:
    """Imbalanced classes' usual sampler: ``samples`` draws with replacement, the second half of the
    set weighted 3 to the first half's 1."""
    weights = torch.cat([torch.ones(samples // 2), torch.full((samples - samples // 2,), 3.0)])
    return WeightedRandomSampler(weights, num_samples=samples, replacement=True)


PAIRED = 10_000  # pair(): a zipped sample's index is its first item's x PAIRED + its second's


def pair(samples: tuple, generators: dict) -> tuple:
    """A ParallelStreamingDataset's transform: the first item's features, label and index with the second
    item's index folded in (so a test reads both), the features nudged by the seeded ``torch`` generator."""
    (x, y, first), (_, _, second) = samples
    nudge = torch.rand((), generator=generators["torch"]) * 1e-3
    return x + nudge, y, first * PAIRED + second


def make_train_loader(config: ScenarioConfig, rank: int) -> DataLoader:
    """Rank ``rank``'s train DataLoader; ``dataset``/``sampler``/``batch_sampler`` select the variants."""
    samples, seed = config.samples, config.data_seed
    batch_size = config.batch_size
    workers = config.num_workers
    common = {
        "num_workers": workers,
        "persistent_workers": config.persistent_workers and workers > 0,
    }
    if config.dataset == "iterable":
        return DataLoader(IterableIndexedDataset(samples, seed=seed), batch_size=batch_size, **common)
    if config.dataset == "shards":
        sharded = ShardedIndexedDataset(
            samples, seed=seed, sized=config.shard_lengths, one_shot_first=config.one_shot_shard
        )
        return DataLoader(sharded, batch_size=batch_size, **common)
    if config.dataset == "litdata":  # IndexedDataset's items, written by litdata.optimize (tests/test_streaming.py)
        from litdata import CombinedStreamingDataset, ParallelStreamingDataset, StreamingDataLoader, StreamingDataset

        if config.litdata_parallel:
            parts = [StreamingDataset(folder, shuffle=config.shuffle, seed=seed) for folder in config.litdata_parallel]
            zipped = ParallelStreamingDataset(
                parts, length=config.parallel_length, seed=seed, resume=config.parallel_resume, transform=pair
            )  # fmt: skip
            return StreamingDataLoader(zipped, batch_size=batch_size, **common)
        if config.litdata_combined:
            parts = [StreamingDataset(folder, shuffle=config.shuffle, seed=seed) for folder in config.litdata_combined]
            weights = config.combined_weights
            combined = CombinedStreamingDataset(
                parts, seed=seed, weights=weights, iterate_over_all=weights is None, batching_method=config.combined_batching
            )  # fmt: skip
            return StreamingDataLoader(combined, batch_size=batch_size, **common)
        if config.litdata_remote:  # LitData's `local:` remote: chunks are downloaded (copied) into the rank's own cache
            cache = Path(config.out) / "litdata-cache" / f"rank{rank}"
            streamed = StreamingDataset(f"local:{config.litdata_dir}", shuffle=config.shuffle, seed=seed, cache_dir=str(cache))
        else:
            streamed = StreamingDataset(config.litdata_dir, shuffle=config.shuffle, seed=seed)
        return StreamingDataLoader(streamed, batch_size=batch_size, **common)
    ds = IndexedDataset(samples, seed=seed)
    kind = config.batch_sampler  # a user batch_sampler: the DataLoader itself has no batch_size
    if kind is not None:
        cls = {"plain": BatchSampler, "subclass": UserBatchSampler, "buckets": LengthBuckets}[kind]
        order = SequentialSampler(ds) if kind == "buckets" else RandomSampler(ds)  # buckets: even DDP ranks
        batches = cls(order, batch_size=batch_size, drop_last=config.drop_last)
        return DataLoader(ds, batch_sampler=batches, **common)
    if config.sampler == "weighted":
        return DataLoader(ds, batch_size=batch_size, sampler=weighted_sampler(samples), drop_last=config.drop_last, **common)
    if config.sampler == "custom":
        return DataLoader(
            ds, batch_size=batch_size, sampler=EveryOtherSampler(len(ds)), drop_last=config.drop_last, **common
        )
    return DataLoader(ds, batch_size=batch_size, shuffle=config.shuffle, drop_last=config.drop_last, **common)


def make_model(kind: str, features: int = 8, classes: int = 4) -> nn.Module:
    if kind == "bn":
        return nn.Sequential(nn.Linear(features, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, classes))
    if kind == "wide_ln":  # a LayerNorm weight of 70,000 ones: its fp16 sum overflows although every value is 1
        return nn.Sequential(nn.Linear(features, 70_000), nn.LayerNorm(70_000), nn.Linear(70_000, classes))
    assert kind == "mlp", kind
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, classes))


def optimizer_state_lists(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """An optimizer's per-parameter state (Adam's moments and step) as JSON lists, to compare across runs."""
    return {
        str(index): {name: value.tolist() if torch.is_tensor(value) else value for name, value in state.items()}
        for index, state in optimizer.state_dict()["state"].items()
    }


def outer_velocity(strategy: Any) -> list[float] | None:
    """The ElChe strategy's outer-optimizer momentum as a list (None: no outer optimizer, or its copies
    not made yet: speeds never differed enough)."""
    settings = getattr(strategy, "settings", None)
    outer = None if settings is None else settings.outer_optimizer
    velocity = None if outer is None else outer.state_dict()["velocity"]
    return None if velocity is None else velocity.tolist()


def param_digest(module: nn.Module) -> str:
    h = hashlib.sha1()
    for tensor in list(module.parameters()) + list(module.buffers()):
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_module(config: ScenarioConfig):
    import lightning.pytorch as pl
    import torchmetrics

    class ScenarioModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(config.model)
            self.automatic_optimization = not config.manual
            self.trained: dict[int, list[int]] = defaultdict(list)
            self.step_batches: list[list[int]] = []
            self.step_lrs: list[float] = []
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)
            if config.metric_sync_on_step:  # a metric that all-gathers on every update
                self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, dist_sync_on_step=True)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            work_s = config.step_work_ms / 1000.0
            if work_s > 0:  # stands in for a heavier model: fixed compute per batch, before backward
                until = time.perf_counter() + work_s
                while time.perf_counter() < until:
                    pass
            # a long step that leaves the CPU to others: it makes the step slower, it synchronises nothing
            time.sleep(config.step_sleep_ms / 1000.0)
            stop_at = config.stop_at  # user code asks to stop on one rank
            if stop_at and self.global_rank == stop_at.rank and batch_idx == stop_at.batch:
                self.trainer.should_stop = True
            for poison in config.nan_at:  # this rank's weights go NaN
                if self.global_rank == poison.rank and batch_idx == poison.batch and self.current_epoch == 0:
                    with torch.no_grad():
                        self.net[0].weight.fill_(float("nan"))
            fail = config.raise_at  # user code raises
            at = (self.current_epoch, batch_idx)
            if fail and fail.rank in (self.global_rank, "all") and at == (fail.epoch, fail.batch):
                mark_fault("ValueError in training_step")
                raise ValueError(f"scenario: rank {self.global_rank} fails in training_step at batch {batch_idx}")
            if config.save_in_step == batch_idx:  # a user checkpoint in the middle of a window
                self.trainer.save_checkpoint(Path(config.out) / "inside_window.ckpt")
            self.trained[self.current_epoch].extend(idx.tolist())
            self.step_batches.append(idx.tolist())
            self.step_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])  # the LR this batch trains with
            if config.log_seen:  # per-rank values for ElCheStrategy(scalar_reductions=...)
                self.log("seen", float(sum(len(b) for b in self.step_batches)), on_step=True, on_epoch=False)
                self.log("rank", float(self.global_rank), on_step=True, on_epoch=False)
            logits = self(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=config.log_step_sync)
            if config.metric_sync_on_step:
                self.train_acc(logits, y)  # all-gathers across ranks on this very batch
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                return None
            return loss

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            logits = self(x)
            self.val_acc(logits, y)
            self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
            if config.val_step_sync:  # a reduce on every validation step
                self.log("val_step_loss", nn.functional.cross_entropy(logits, y), on_step=True, sync_dist=True)
            self.log("val_acc", self.val_acc, on_epoch=True)

        def configure_optimizers(self):
            lr = config.lr
            if config.optimizer == "adam":
                optimizer = torch.optim.Adam(self.parameters(), lr=lr)
            else:
                optimizer = torch.optim.SGD(self.parameters(), lr=lr)
            if config.one_cycle:  # OneCycleLR over estimated_stepping_batches, the usual Lightning set-up
                self.estimated_stepping_batches = self.trainer.estimated_stepping_batches
                scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=self.estimated_stepping_batches)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
            step_lr = config.step_lr  # a per-step schedule
            if step_lr is None:
                return optimizer
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_lr.step_size, gamma=step_lr.gamma)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self):
            return make_train_loader(config, self.global_rank)

        def val_dataloader(self):
            if not config.validate:
                return []
            if config.validate_on_train:  # the training set itself: val_loss is the training loss
                return DataLoader(IndexedDataset(config.samples, seed=config.data_seed), batch_size=64)
            return DataLoader(IndexedDataset(config.val_samples, seed=99), batch_size=16)

    if config.training_step == "dataloader_iter":

        class DataloaderIterModule(ScenarioModule):
            def training_step(self, dataloader_iter):  # fetches its own batches
                batch, batch_idx, _ = next(dataloader_iter)
                return super().training_step(batch, batch_idx)

        return DataloaderIterModule()
    return ScenarioModule()


def make_checkpoint_io(fail_at: int = 0, delay_s: float = 0.0):
    """Lightning's CheckpointIO with a full disk at the ``fail_at``-th write (a real OSError, which a
    read-only directory would not give when the tests run as root) or a slow write of ``delay_s``."""
    import errno

    from lightning.fabric.plugins import TorchCheckpointIO

    class FaultyCheckpointIO(TorchCheckpointIO):
        writes = 0

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.writes += 1
            if self.writes == fail_at:
                mark_fault("ENOSPC")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            time.sleep(delay_s)  # a slow disk: the write takes longer, it synchronises nothing
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    return FaultyCheckpointIO()


def make_recording_logger():
    """A Lightning logger that keeps every (metric, step) it is given, on every rank."""
    from lightning.pytorch.loggers.logger import Logger

    class RecordingLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.points: list[list[Any]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.points.extend([key, step] for key in sorted(metrics))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return RecordingLogger()


def make_run_logger(kind: str, out: Path):
    """A logger whose run a new rank 0 must continue: CSV's version folder (every row written at once, as
    a killed rank 0 leaves it), W&B's run id (offline) or MLflow's (a file store, which MLflow 3 allows on request)."""
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(out / "csv", name="", flush_logs_every_n_steps=1)
    if kind == "wandb":
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, silent=True)
        return WandbLogger(save_dir=str(out), offline=True, project="elche", settings=settings)
    from lightning.pytorch.loggers import MLFlowLogger

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    return MLFlowLogger(experiment_name="elche", tracking_uri=(out / "mlruns").as_uri())


class Recorder:
    """Lightning callback: phases for the tracer, parameter digests after every boundary."""

    def __new__(cls, strategy: Any, config: ScenarioConfig):
        import lightning.pytorch as pl

        class _Recorder(pl.Callback):
            def __init__(self) -> None:
                self.digests: list[str] = []
                self.boundary_global_steps: list[int] = []
                self.boundary_batches: list[list[int]] = []  # [epoch, batch_idx] of each boundary
                self.seen_boundaries = 0
                self.saved = 0
                self.saved_steps: list[int] = []  # trainer.global_step at each checkpoint taken (in memory too)
                self.validated_at: list[int] = []  # trainer.global_step at each validation in the fit
                # each validation of the fit: the indices this rank validated, its seconds from start to its
                # last batch's end and to the validation's end (after the metrics' reduce), and val_loss
                self.validations: list[dict[str, Any]] = []
                self.crash_due = False
                self.sigterm_sent: dict[str, int] | None = None
                self.signals_sent: list[dict[str, Any]] = []  # the ``signals`` notices this rank sent
                self.optimizer_state_at_start: dict[str, Any] | None = None
                self.outer_velocity_at_start: list[float] | None = None

            def setup(self, trainer, pl_module, stage):
                if config.signals:  # where ``"to": "all"`` finds every rank
                    out = Path(config.out)
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"pid_rank{trainer.global_rank}").write_text(str(os.getpid()))

            def on_train_start(self, trainer, pl_module):
                """``record_optimizer_state``: what the fit starts from (after a resume: what it restored).
                And a digest of the parameters right after each boundary, however many run in one batch."""
                self.pending_digests = []
                callback = getattr(strategy, "callback", None)
                if callback is not None and not getattr(callback, "_scenario_recorded", False):
                    run_boundary = callback._boundary

                    def recorded_boundary(trainer, cohort):
                        run_boundary(trainer, cohort)
                        self.pending_digests.append((param_digest(pl_module), trainer.global_step))

                    callback._boundary, callback._scenario_recorded = recorded_boundary, True
                world = getattr(strategy, "world", None)
                if "ELCHE_MEMBER_ID" in os.environ and world is not None and not getattr(world, "_scenario_noted", False):
                    admit = world.after_boundary

                    def noted_then_admitting(session, control, checkpoints):
                        """A committed boundary: what this member trained is in the consensus (a member lost as
                        joiners come in, from here on, is counted by it)."""
                        self.note_member(pl_module, len(strategy.boundaries))
                        admit(session, control, checkpoints)

                    world.after_boundary, world._scenario_noted = noted_then_admitting, True
                if config.record_optimizer_state:
                    self.optimizer_state_at_start = optimizer_state_lists(trainer.optimizers[0])
                    self.outer_velocity_at_start = outer_velocity(strategy)

            def _signal_if_due(self, trainer, phase, batch_idx):
                """``signals`` (:class:`scenario_config.Signal`): ``count`` SIGTERMs from ``rank`` at a point of
                ``phase``, to itself or, with ``to="all"``, to every rank at once (SLURM's preemption)."""
                for number, notice in enumerate(config.signals):
                    if (
                        any(sent["number"] == number for sent in self.signals_sent)
                        or trainer.global_rank != notice.rank
                        or notice.phase != phase
                    ):
                        continue
                    if phase == "final_window":
                        cohort, last_epoch = strategy.cohort, trainer.max_epochs - 1
                        plan = cohort.plan
                        if not (trainer.current_epoch == last_epoch and plan.complete
                                and cohort.clock.window == len(plan.sizes) - 1):
                            continue
                    elif trainer.current_epoch != notice.epoch or batch_idx != notice.batch:
                        continue
                    self.signals_sent.append({
                        "number": number, "phase": phase, "epoch": trainer.current_epoch, "batch": batch_idx,
                        "boundaries_before": len(getattr(strategy, "boundaries", [])),
                    })
                    pids = [os.getpid()]
                    if notice.to == "all":
                        pids = [int(p.read_text()) for p in Path(config.out).glob("pid_rank*")]
                        pids.sort(key=lambda pid: pid == os.getpid())  # this rank last
                    for _ in range(notice.count):
                        for pid in pids:
                            os.kill(pid, signal.SIGTERM)

            def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
                if self.validations and not trainer.sanity_checking:
                    self.validations[-1]["indices"].extend(batch[2].tolist())
                    self.validations[-1]["batches_s"] = time.perf_counter() - self.validations[-1]["started"]
                self._signal_if_due(trainer, "sanity" if trainer.sanity_checking else "validation", batch_idx)

            def on_validation_epoch_end(self, trainer, pl_module):
                if self.validations and not trainer.sanity_checking:
                    self.validations[-1]["epoch_end_started_s"] = time.perf_counter() - self.validations[-1]["started"]

            def on_validation_end(self, trainer, pl_module):
                if self.validations and not trainer.sanity_checking:
                    done = self.validations[-1]
                    done["total_s"] = time.perf_counter() - done.pop("started")
                    done["val_loss"] = float(trainer.callback_metrics["val_loss"])

            def on_train_epoch_start(self, trainer, pl_module):
                TRACER.phase, TRACER.epoch = "train", trainer.current_epoch
                self._crash_if_due(trainer)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                TRACER.phase, TRACER.epoch, TRACER.batch = "train", trainer.current_epoch, batch_idx
                self._crash_if_due(trainer)
                self._signal_if_due(trainer, "final_window", batch_idx)
                kill = config.kill_at  # killed in its epoch's last window
                if kill and kill.window == "last" and trainer.global_rank == kill.rank and (
                    trainer.current_epoch == kill.epoch
                ):
                    plan = strategy.cohort.plan
                    if plan.complete and strategy.cohort.clock.window == len(plan.sizes) - 1:
                        mark_fault("SIGKILL")
                        os.kill(os.getpid(), signal.SIGKILL)

            def on_save_checkpoint(self, trainer, pl_module, checkpoint):
                """``crash_after_checkpoints: k``: note what the k-th checkpoint covers, crash right after it."""
                kill = config.kill_at  # killed as the checkpoint is taken, before rank 0 writes it; once (the
                if kill and kill.phase == "checkpoint" and trainer.global_rank == kill.rank and (
                    trainer.current_epoch == kill.epoch  # survivors take it again, under a new rank 0)
                    and not (Path(config.out) / "fault.json").exists()
                ):
                    mark_fault("SIGKILL")
                    os.kill(os.getpid(), signal.SIGKILL)
                self.saved += 1
                self.saved_steps.append(trainer.global_step)
                if self.saved == config.crash_after_checkpoints:
                    snapshot = {"trained": {str(k): list(v) for k, v in pl_module.trained.items()},
                                "global_step": trainer.global_step, "digest": param_digest(pl_module)}
                    out = Path(config.out)
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"crash_rank{trainer.global_rank}.json").write_text(json.dumps(snapshot))
                    self.crash_due = True

            def _crash_if_due(self, trainer):
                if self.crash_due:  # the checkpoint file is written: die as a killed job would, no cleanup
                    os._exit(CRASH_EXIT_CODE)

            def note_member(self, pl_module, boundaries: int) -> None:
                """``member<id>_at_boundary.json``: what this member trained, all of it in the consensus."""
                snapshot = {"boundaries": boundaries, "trained": {str(k): list(v) for k, v in pl_module.trained.items()}}
                out = Path(config.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"member{os.environ['ELCHE_MEMBER_ID']}_at_boundary.json").write_text(json.dumps(snapshot))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                boundaries = getattr(strategy, "boundaries", None)
                if boundaries is not None and len(boundaries) > self.seen_boundaries:
                    # Read after each boundary: under dynamic dispatch a rank whose epoch ran out runs
                    # several in one batch, each seen here through the digests the callback left.
                    for digest, step in self.pending_digests:
                        self.digests.append(digest)
                        self.boundary_global_steps.append(step)
                        self.boundary_batches.append([trainer.current_epoch, batch_idx])
                    self.seen_boundaries = len(boundaries)
                    if "ELCHE_MEMBER_ID" in os.environ:  # an elastic launch: what this member's consensus holds
                        self.note_member(pl_module, len(boundaries))
                self.pending_digests = []
                kill = config.kill_at  # SIGKILLed (or SIGSTOPped) after a batch, once per fit: a member that
                # takes the victim's rank after the regroup reaches the same batch again
                if (
                    kill
                    and kill.batch is not None
                    and trainer.global_rank == kill.rank
                    and trainer.current_epoch == kill.epoch
                    and batch_idx == kill.batch
                    and not (Path(config.out) / "fault.json").exists()
                ):
                    mark_fault(kill.signal)
                    os.kill(os.getpid(), getattr(signal, kill.signal))
                sigterm = config.sigterm_at
                if (
                    sigterm is not None
                    and self.sigterm_sent is None
                    and trainer.global_rank == sigterm.rank
                    and trainer.current_epoch == sigterm.epoch
                    and batch_idx == sigterm.batch
                ):
                    self.sigterm_sent = {
                        "epoch": trainer.current_epoch,
                        "batch": batch_idx,
                        "boundaries_before": len(boundaries or []),
                    }
                    # preemption of this rank only (or SLURM's requeue signal, with "signal": "SIGUSR1")
                    os.kill(os.getpid(), getattr(signal, sigterm.signal))
                self._signal_if_due(trainer, "train", batch_idx)

            def on_validation_start(self, trainer, pl_module):
                TRACER.phase = "validation"
                if trainer.state.fn == "fit" and not trainer.sanity_checking:
                    self.validated_at.append(trainer.global_step)
                    self.validations.append({"indices": [], "started": time.perf_counter()})
                self._crash_if_due(trainer)
                kill = config.kill_at  # killed as validation starts
                if kill and kill.phase == "validation" and trainer.global_rank == kill.rank and (
                    not trainer.sanity_checking and trainer.current_epoch == kill.epoch
                ):
                    mark_fault("SIGKILL")
                    os.kill(os.getpid(), signal.SIGKILL)

            def on_train_epoch_end(self, trainer, pl_module):
                TRACER.phase = "epoch_end"
                self._crash_if_due(trainer)

            def on_train_end(self, trainer, pl_module):
                TRACER.phase = "teardown"
                self._crash_if_due(trainer)

        return _Recorder()


def this_ranks_config(config: ScenarioConfig) -> ScenarioConfig:
    """``config`` with ``per_rank[rank]`` laid over it (see :meth:`ScenarioConfig.for_rank`), the rank read
    from the launcher's environment: ``{"per_rank": {"1": {"samples": 97}}}`` misconfigures rank 1 only."""
    rank = next((os.environ[name] for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK") if name in os.environ), "0")
    return config.for_rank(int(rank))


def start_late(after_s: float) -> None:
    """This member is slow to start: it waits until another member waits for it at the first generation's
    rendezvous, then ``after_s`` more (the slow start itself, not a synchronisation) before it begins."""
    from lightning_elche.comm.rendezvous import agent_store

    store = agent_store()
    while int(store.add("elche/elastic/ready/0", 0)) == 0:
        time.sleep(0.05)  # polls the store: another member's arrival ends the wait
    time.sleep(after_s)


def main(config: ScenarioConfig) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy, OuterNesterov, Slowdown

    config = this_ranks_config(config)
    if config.out is None:
        raise ValueError("scenario: the config names no output folder (`out`)")
    TRACER.out = Path(config.out)
    if config.trace:
        TRACER.install()
        TRACER.fault = config.collective_fault
    torch.set_num_threads(1)
    pl.seed_everything(config.seed, verbose=False)
    if config.strategy == "elche":
        outer = config.outer  # DiLoCo's outer step
        outer_optimizer = (
            None if outer is None else OuterNesterov(lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
        )
        io = config.checkpoint_io  # rank 0's n-th write fails / every write is slow
        checkpoint_io = None if io is None else make_checkpoint_io(fail_at=io.fail_at, delay_s=io.delay_s)
        strategy = ElCheStrategy(
            **{"timeout": 60, "outer_optimizer": outer_optimizer, "checkpoint_io": checkpoint_io, **thaw(config.elche)}
        )
        strategy.checkpoints.single_file = config.single_file_checkpoints
    else:
        strategy = config.strategy
    slow: dict[int, Any] = dict(config.slow)
    switch = config.slow_switch
    if switch is not None:  # a rank whose speed changes after `after` local optimizer steps
        after, before_k, after_k = switch.after, float(switch.before_k), float(switch.after_k)
        slow[switch.rank] = lambda step: before_k if step < after else after_k
    module = build_module(config)
    callbacks = [Slowdown(slow, clock=config.slow_clock)] if slow else []
    recorder = Recorder(strategy, config)
    callbacks.append(recorder)
    checkpoint_dir = Path(config.out) / "checkpoints"
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

    every_n = config.checkpoint_every_n_steps
    if every_n:  # one checkpoint per N DDP-equivalent steps, all kept
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir, every_n_train_steps=every_n, save_top_k=-1,
                save_last=config.checkpoint_save_last,
            )
        )
    monitor = config.checkpoint_monitor
    if monitor:
        callbacks.append(ModelCheckpoint(
            dirpath=checkpoint_dir, monitor=monitor.monitor, mode=monitor.mode, save_top_k=monitor.save_top_k,
            every_n_train_steps=monitor.every_n_train_steps or None,
        ))
    if config.checkpoint_every_s is not None:
        from datetime import timedelta

        callbacks.append(ModelCheckpoint(
            dirpath=checkpoint_dir / "timed", train_time_interval=timedelta(seconds=config.checkpoint_every_s),
            save_top_k=-1,
        ))
    stopping = config.early_stopping
    if stopping:
        callbacks.append(EarlyStopping(
            monitor=stopping.monitor, min_delta=stopping.min_delta, patience=stopping.patience, mode=stopping.mode
        ))
    if config.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(Path(config.out) / "tb", name="", version=config.tensorboard_version)
    else:
        logger = make_recording_logger() if config.record_logs else False
    loggers = ([logger] if logger else []) + [make_run_logger(kind, Path(config.out)) for kind in config.run_loggers]
    if loggers and config.lr_monitor:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=config.devices,
        strategy=strategy,
        max_epochs=config.epochs,
        callbacks=callbacks,
        logger=loggers or False,
        log_every_n_steps=config.log_every_n_steps,
        enable_checkpointing=bool(every_n or monitor or config.checkpoint_every_s is not None),
        enable_progress_bar=config.progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=config.sanity,
        **thaw(config.trainer),
    )
    initial = [p.detach().clone() for p in module.parameters()]
    if config.late_start is not None and int(os.environ.get("ELCHE_MEMBER_ID", -1)) == config.late_start.member:
        start_late(config.late_start.after_s)
    if config.joiner_dies_at_admission and os.environ.get("ELCHE_JOIN") == "1":
        die_at_admission()
    dies = config.dies_joining_group
    if dies is not None and int(os.environ.get("ELCHE_MEMBER_ID", -1)) == dies.member:
        die_joining_group(dies.nth)
    started = time.perf_counter()
    exception: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, ckpt_path=config.ckpt_path, weights_only=config.weights_only)
        except BaseException as exc:  # recorded, then re-raised unless it is Lightning's SIGTERM stop
            exception = exc
        finally:
            elche_warnings = [str(w.message) for w in caught if "ElChe" in str(w.message)]
            if not (isinstance(exception, SystemExit) and os.environ.get("ELCHE_SPARE") == "1"):  # a spare not needed had no rank
                    write_result(config, trainer, module, recorder, initial, exception, time.perf_counter() - started,
                             elche_warnings)
            if config.strategy == "ddp" and exception is None:
                # Rank 0 hosts the rendezvous store: it leaves only once every rank wrote its result (rank 1
                # of a DDP comparison run, still in Lightning's teardown when rank 0 left, once aborted).
                dist.barrier()
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if exception is not None and not isinstance(exception, SIGTERMException):
        raise exception


def write_result(
    config: ScenarioConfig, trainer, module, recorder, initial, exception, elapsed_s: float, elche_warnings
) -> None:
    import lightning_elche

    rank = trainer.global_rank
    boundaries = getattr(trainer.strategy, "boundaries", [])
    result = {
        "rank": rank,
        "version": lightning_elche.__version__,
        "global_step": trainer.global_step,
        "max_steps": trainer.max_steps,
        "estimated_stepping_batches": getattr(module, "estimated_stepping_batches", None),
        "current_epoch": trainer.current_epoch,
        "trained": {str(k): v for k, v in module.trained.items()},
        "step_batches": module.step_batches,
        "step_lrs": module.step_lrs,
        "digests": recorder.digests,
        "boundary_global_steps": recorder.boundary_global_steps,
        "boundary_batches": recorder.boundary_batches,
        "sigterm_sent": recorder.sigterm_sent,
        "signals_sent": recorder.signals_sent,
        "optimizer_state_at_start": recorder.optimizer_state_at_start,
        "outer_velocity_at_start": recorder.outer_velocity_at_start,
        "final_optimizer_state": (
            optimizer_state_lists(trainer.optimizers[0]) if config.record_optimizer_state and trainer.optimizers
            else None
        ),
        "final_outer_velocity": outer_velocity(trainer.strategy) if config.record_optimizer_state else None,
        "exception": None if exception is None else type(exception).__name__,
        "exception_message": None if exception is None else str(exception)[:2000],
        "elapsed_s": elapsed_s,
        "warnings": elche_warnings,
        "boundaries": [b.__dict__ for b in boundaries],
        "calls": TRACER.calls,
        # "record_params": false leaves out the parameter values (a wide model's are tens of MB of JSON)
        "initial": [t.tolist() for t in initial] if config.record_params else [],
        "final": [p.detach().tolist() for p in module.parameters()] if config.record_params else [],
        "final_digest": param_digest(module),
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "final_lr": trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
        "logged": getattr(trainer.logger, "points", []),
        "best_checkpoint": Path(trainer.checkpoint_callback.best_model_path).name if trainer.checkpoint_callback else None,
        "saved_steps": recorder.saved_steps,
        "validated_at": recorder.validated_at,
        "validations": recorder.validations,
        "timed_checkpoints": sorted(p.name for p in (Path(config.out) / "checkpoints" / "timed").glob("*.ckpt")),
        "best_k_checkpoints": (  # this rank's ModelCheckpoint's kept files and their scores
            {Path(path).name: float(score) for path, score in trainer.checkpoint_callback.best_k_models.items()}
            if trainer.checkpoint_callback else {}
        ),
        "checkpoints": sorted(p.name for p in (Path(config.out) / "checkpoints").glob("*.ckpt")),
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from prefork import fork_ranks, wait_for_ranks

    scenario = ScenarioConfig.from_json(sys.argv[1])
    fork_ranks(scenario.devices)  # before anything runs: Lightning's launcher takes them
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    # ElChe destroys its gloo group at exit itself; do the same for the plain-DDP comparison runs,
    # which Lightning leaves to interpreter shutdown (an occasional abort after a finished run).
    atexit.register(_destroy_dist_connection)
    main(scenario)
    wait_for_ranks()  # the tests read every rank's result once this process has exited
