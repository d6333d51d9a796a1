"""The configuration of ``tests/scenario.py``, typed and frozen: every key named once, with its default
and what it does.

The tests build it with :meth:`ScenarioConfig.from_dict` (``conftest.run_scenario``'s keyword
arguments), which refuses a key it does not know, at any depth, naming it: a misspelt feature fails
the test at once instead of running a scenario without it. The scenario's processes receive it as
JSON (:meth:`ScenarioConfig.to_json`) and rebuild the same object (:meth:`ScenarioConfig.from_json`).
Every field is checked against its type on construction; an enumerated string outside its
``Literal`` is refused.

Imports neither torch nor Lightning, so that ``conftest`` imports it for nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

CollectiveOp = Literal[  # the torch.distributed calls the scenario's tracer wraps
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
    "reduce", "gather", "gather_object", "scatter", "all_to_all", "reduce_scatter", "all_gather_into_tensor",
    "reduce_scatter_tensor", "monitored_barrier", "send", "recv", "all_to_all_single", "all_gather_single",
]
TracerPhase = Literal["setup", "train", "validation", "epoch_end", "teardown"]  # where the tracer says a call is

T = TypeVar("T", bound="_Config")
_WHERE: ContextVar[str] = ContextVar("scenario_config_where", default="")  # the path from_dict is building


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


class _Config:
    """What every configuration dataclass here shares: built from a mapping (unknown keys refused),
    each field converted and checked against its type in ``__post_init__``, written back as JSON."""

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
        """``data``'s keys as this dataclass's fields; ``where`` (``"kill_at"``, ``"per_rank[1]"``...)
        places a nested one in error messages."""
        if not isinstance(data, Mapping):
            raise ValueError(f"scenario key {where!r} must be a mapping of keys, got {data!r}")
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = [key for key in data if key not in known]
        if unknown:
            raise ValueError(
                f"unknown scenario key(s) {', '.join(repr(key) for key in unknown)}"
                f"{f' in {where}' if where else ''}; known keys: {', '.join(known)}"
            )
        token = _WHERE.set(where)
        try:
            return cls(**data)
        finally:
            _WHERE.reset(token)

    def __post_init__(self) -> None:
        where = _WHERE.get()
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            path = f"{where}.{f.name}" if where else f.name
            object.__setattr__(self, f.name, _convert(hints[f.name], getattr(self, f.name), path))
        self._check(where)

    def _check(self, where: str) -> None:
        """Rules across fields (one of several keys given, say); ``where`` as in :meth:`from_dict`."""

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as JSON data (nested dataclasses as dicts)."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != _default(f)
        }


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _convert(hint: Any, value: Any, path: str) -> Any:
    """``value`` (JSON data, or already of the field's type) as ``hint`` says, or a ValueError naming ``path``."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return _freeze(value, path)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        arms = [arm for arm in args if arm is not type(None)]
        if len(arms) == 1:
            return _convert(arms[0], value, path)
        errors = []
        for arm in arms:
            try:
                return _convert(arm, value, path)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(f"scenario key {path!r}: {value!r} fits none of its types ({'; '.join(errors)})")
    if origin is Literal:
        if not any(value == choice and type(value) is type(choice) for choice in args):
            raise ValueError(f"scenario key {path!r} must be one of {', '.join(map(repr, args))}; got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"scenario key {path!r} must be a list, got {value!r}")
        return tuple(_convert(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"scenario key {path!r} must be a mapping, got {value!r}")
        key_type, value_type = args
        return MappingProxyType(
            {_key(key_type, k, path): _convert(value_type, v, f"{path}[{k!r}]") for k, v in value.items()}
        )
    if isinstance(hint, type) and issubclass(hint, _Config):
        return value if isinstance(value, hint) else hint.from_dict(value, where=path)
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ValueError(f"scenario key {path!r} must be of type {hint.__name__}, got {value!r}")
    return value


def _key(key_type: Any, key: Any, path: str) -> Any:
    """A mapping's key: a rank (``1`` or JSON's ``"1"``) as an int; a keyword as a str."""
    if key_type is int:
        if isinstance(key, str) and key.isdigit():
            return int(key)
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            return key
        raise ValueError(f"scenario key {path!r}: {key!r} is not a rank")
    if not isinstance(key, str):
        raise ValueError(f"scenario key {path!r}: {key!r} is not a str key")
    return key


def _freeze(value: Any, path: str) -> Any:
    """Free-form JSON data made read-only: mappings as read-only mappings, lists as tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({_key(str, k, path): _freeze(v, f"{path}[{k!r}]") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{path}[{i}]") for i, item in enumerate(value))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(f"scenario key {path!r}: {value!r} is not JSON data")


def thaw(value: Any) -> Any:
    """Frozen data as plain dicts and lists again (keyword arguments for the Trainer or the strategy)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(item) for item in value]
    return value


def _plain(value: Any) -> Any:
    """A field's value as JSON data (a rank key as a str, as JSON has it)."""
    if isinstance(value, _Config):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


# --------------------------------------------------------------------------- the structured keys


@dataclass(frozen=True)
class RankBatch(_Config):
    """A batch of one rank (``stop_at``, ``nan_at``)."""

    rank: int  # the rank it happens on
    batch: int  # at this batch index (of each epoch for stop_at, of epoch 0 for nan_at)


@dataclass(frozen=True)
class RaiseAt(_Config):
    """``raise_at``: user code raises a ValueError in ``training_step``."""

    rank: Union[int, Literal["all"]]  # the rank that raises, or "all" of them
    batch: int  # at this batch index
    epoch: int = 0  # of this epoch


@dataclass(frozen=True)
class KillAt(_Config):
    """``kill_at``: a rank is killed at one point (exactly one of ``batch``, ``window``, ``phase``)."""

    rank: int  # the rank killed
    epoch: int = 0  # in this epoch
    batch: int | None = None  # after this batch index (sent ``signal``)
    window: Literal["last"] | None = None  # "last": SIGKILLed as its epoch's last window starts
    # "checkpoint": while the epoch's checkpoint is taken, before rank 0 writes it; once (the survivors take it
    # again, under a new rank 0)
    phase: Literal["validation", "checkpoint"] | None = None  # SIGKILLed as validation / the epoch's checkpoint starts
    signal: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL"  # what ``batch`` sends (SIGSTOP: a stalled rank)

    def _check(self, where: str) -> None:
        given = [name for name in ("batch", "window", "phase") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"scenario key {where!r} needs exactly one of 'batch', 'window', 'phase'; got {given}")
        if self.signal != "SIGKILL" and self.batch is None:
            raise ValueError(f"scenario key {where!r}: 'signal' is sent only with 'batch' (the others SIGKILL)")


@dataclass(frozen=True)
class SigtermAt(_Config):
    """``sigterm_at``: one rank is sent a preemption notice (to itself only) after a batch."""

    rank: int  # the rank that signals itself
    batch: int  # after this batch index
    epoch: int = 0  # of this epoch
    signal: Literal["SIGTERM", "SIGUSR1"] = "SIGTERM"  # SIGUSR1: SLURM's requeue signal


@dataclass(frozen=True)
class LateStart(_Config):
    """``late_start``: an elastic launch's member starts its fit late, as on a loaded machine: once another
    member waits for it at the first generation's rendezvous, ``after_s`` later (its heartbeat not started)."""

    member: int  # the member id (the launch rank) that starts late
    after_s: float  # how much later than the first member's arrival


@dataclass(frozen=True)
class DiesJoiningGroup(_Config):
    """``dies_joining_group``: an elastic member SIGKILLs itself as it starts to form a generation's process
    group, after every member said it was ready (its ``nth`` group of the fit: 2 is the first after a change)."""

    member: int  # the member id
    nth: int  # its nth process group, counted from 1 (the first generation's)


@dataclass(frozen=True)
class Signal(_Config):
    """One of ``signals``: ``count`` SIGTERMs from ``rank`` at a point of ``phase``, to itself or every rank."""

    rank: int  # the rank that sends them
    # "train", "validation", "sanity": after a batch of that loop; "final_window": before the first batch of the
    # fit's last window
    phase: Literal["train", "validation", "sanity", "final_window"] = "train"  # when
    epoch: int = 0  # in this epoch (not for "final_window")
    batch: int = 0  # after this batch index (not for "final_window")
    count: int = 1  # how many SIGTERMs, back to back
    to: Literal["self", "all"] = "self"  # "all": every rank at once, as SLURM's preemption does


@dataclass(frozen=True)
class CollectiveFault(_Config):
    """``collective_fault``: at the ``nth`` collective matching ``op``, ``origin`` and ``phase`` (counted
    alike on every rank), ``rank`` is SIGKILLed (the fault hook, ``CollectiveTracer._inject_fault``)."""

    rank: int  # the rank that dies
    nth: int  # at the nth matching collective, counted from 1
    op: CollectiveOp = "all_reduce"  # the torch.distributed call
    origin: str = "elche:"  # the caller's origin starts with this ("elche:averaging": ElChe's averaging module)
    phase: TracerPhase | None = None  # counted only in this phase (None: in any)
    when: Literal["before", "inside"] = "before"  # right before entering it, or while it waits inside it
    inside_s: float = 0.5  # "inside": how long it waits inside before it dies (its peers arrive after its death)


@dataclass(frozen=True)
class CheckpointIOFaults(_Config):
    """``checkpoint_io``: the strategy's CheckpointIO, which fails or is slow on rank 0."""

    fail_at: int = 0  # the nth write fails with ENOSPC (0: none fails)
    delay_s: float = 0.0  # each write takes this much longer


@dataclass(frozen=True)
class SlowSwitch(_Config):
    """``slow_switch``: a rank whose speed changes after ``after`` local optimizer steps (lightning_elche.Slowdown)."""

    rank: int  # the rank
    after: int  # its local optimizer steps before the change
    before_k: float  # how many times slower it is before
    after_k: float  # and after


@dataclass(frozen=True)
class Outer(_Config):
    """``outer``: DiLoCo's outer step, lightning_elche.OuterNesterov's arguments (its defaults)."""

    lr: float = 0.7  # the outer learning rate
    momentum: float = 0.9  # the outer momentum
    nesterov: bool = True  # Nesterov momentum (False: heavy ball)


@dataclass(frozen=True)
class StepLR(_Config):
    """``step_lr``: torch.optim.lr_scheduler.StepLR, stepped every optimizer step."""

    step_size: int  # the LR is multiplied by gamma every step_size steps
    gamma: float = 0.1  # by this (StepLR's default)


@dataclass(frozen=True)
class CheckpointMonitor(_Config):
    """``checkpoint_monitor``: a ModelCheckpoint callback (checkpoints at each epoch's end, or every N steps)
    with these arguments."""

    monitor: str | None = None  # the logged metric ranked (None: the newest is best)
    mode: Literal["min", "max"] = "min"  # whether smaller or larger is better
    save_top_k: int = 1  # how many are kept (-1: all)
    every_n_train_steps: int = 0  # > 0: at the boundaries that pass each multiple of N steps instead


@dataclass(frozen=True)
class EarlyStopping(_Config):
    """``early_stopping``: an EarlyStopping callback with these arguments (its defaults)."""

    monitor: str  # the logged metric watched
    min_delta: float = 0.0  # a smaller change is no improvement
    patience: int = 3  # validations without improvement before it stops the fit
    mode: Literal["min", "max"] = "min"  # whether smaller or larger is better


# --------------------------------------------------------------------------- the scenario


@dataclass(frozen=True)
class ScenarioConfig(_Config):
    """One multi-process training run of ``tests/scenario.py``."""

    # where and how many
    out: str | None = None  # the folder each rank writes rank<r>.json into (conftest's runners set it)
    devices: int = 2  # ranks (Trainer(devices=...); the srun-style runners start this many)
    strategy: Literal["elche", "ddp"] = "elche"  # ElCheStrategy, or Lightning's DDP for comparison
    elche: Mapping[str, Any] = field(default_factory=_empty)  # ElCheStrategy's keyword arguments (over timeout=60)
    trainer: Mapping[str, Any] = field(default_factory=_empty)  # more Trainer keyword arguments
    # {"1": {"samples": 97}} misconfigures rank 1 only; mappings are merged one level deep (see for_rank)
    per_rank: Mapping[int, Mapping[str, Any]] = field(default_factory=_empty)  # {rank: keys for that rank only}
    epochs: int = 2  # Trainer(max_epochs=...)
    seed: int = 0  # seed_everything's seed (the sampler's shuffle seed too)
    # the data
    samples: int = 256  # training set size
    data_seed: int = 0  # the seed the training set is drawn with
    batch_size: int = 8  # the train DataLoader's batch size
    # "shards": ElChe's sharded-iterable protocol, shards of uneven sizes
    dataset: Literal["map", "iterable", "shards", "litdata"] = "map"  # map-style, streamed, sharded, or litdata's
    shard_lengths: bool = True  # "shards": each shard has a len() (else ElChe counts them)
    one_shot_shard: bool = False  # "shards": the first shard is a generator, readable once, without len() (refused)
    litdata_dir: str | None = None  # "litdata": the folder litdata.optimize wrote (tests/test_streaming.py)
    litdata_remote: bool = False  # "litdata": read litdata_dir as remote storage, each rank downloading to its own cache
    litdata_combined: tuple[str, ...] = ()  # "litdata": a CombinedStreamingDataset of these folders' items
    combined_weights: tuple[float, ...] | None = None  # CombinedStreamingDataset(weights=..., iterate_over_all=False)
    combined_batching: Literal["stratified", "per_stream"] = "stratified"  # its batching_method
    litdata_parallel: tuple[str, ...] = ()  # "litdata": a ParallelStreamingDataset of these folders' items (scenario.pair)
    parallel_length: int | float | None = None  # its length (None: the shortest dataset's; an int: the datasets cycle; inf: endless)
    parallel_resume: bool = True  # its resume: cycled streams go on across epochs
    shuffle: bool = True  # the train DataLoader shuffles (and litdata's dataset)
    drop_last: bool = False  # the train DataLoader / batch sampler drops the last partial batch
    batch_sampler: Literal["plain", "subclass", "buckets"] | None = None  # a user's: torch's, a subclass, LengthBuckets
    sampler: Literal["custom", "weighted"] | None = None  # neither Random nor Sequential; scenario.weighted_sampler
    num_workers: int = 0  # DataLoader workers
    persistent_workers: bool = False  # DataLoader(persistent_workers=...), with num_workers > 0 only
    validate: bool = True  # a validation loader (``val_samples`` held-out items, batches of 16)
    val_samples: int = 64  # validation items
    val_step_sync: bool = False  # also log a metric with sync_dist=True on every validation step
    validate_on_train: bool = False  # validate on the training set itself: val_loss is the training loss
    sanity: int = 0  # Trainer(num_sanity_val_steps=...)
    # the model and its training
    # "wide_ln": a LayerNorm of 70,000 weights, whose fp16 sum overflows although every value is 1
    model: Literal["mlp", "bn", "wide_ln"] = "mlp"  # Linear-Tanh-Linear, with BatchNorm, or very wide
    optimizer: Literal["sgd", "adam"] = "sgd"  # the optimizer
    lr: float = 0.1  # its learning rate
    one_cycle: bool = False  # OneCycleLR over trainer.estimated_stepping_batches, stepped every step
    step_lr: StepLR | None = None  # a StepLR schedule, stepped every step
    outer: Outer | None = None  # ElChe's outer optimizer (DiLoCo's outer Nesterov step)
    manual: bool = False  # manual optimization (training_step steps the optimizer itself)
    training_step: Literal["dataloader_iter"] | None = None  # "dataloader_iter": training_step fetches its batches
    metric_sync_on_step: bool = False  # a torchmetrics metric that all-gathers on every update
    log_seen: bool = False  # log per-rank "seen" (samples trained) and "rank" every step
    log_step_sync: bool = False  # log train_loss with sync_dist=True
    # speeds
    slow: Mapping[int, float] = field(default_factory=_empty)  # {rank: k}: that rank k times slower (Slowdown)
    slow_switch: SlowSwitch | None = None  # a rank whose slowdown changes mid-fit
    # "wall" keeps a rank k times slower in wall time also when a loaded machine starves every rank of CPU (which
    # the thread clock would not stretch); not the default: it also stretches waiting inside a step (a regroup) k times
    slow_clock: Literal["thread", "cpu", "wall"] = "thread"  # the clock Slowdown stretches a step in
    step_work_ms: float = 0  # busy CPU work per batch before backward (stands in for a heavier model)
    step_sleep_ms: float = 0  # a sleep per batch: a long step that leaves the CPU to others
    # faults and interruptions
    stop_at: RankBatch | None = None  # user code sets trainer.should_stop on one rank at a batch (every epoch)
    nan_at: tuple[RankBatch, ...] = ()  # ranks whose weights go NaN at a batch of epoch 0
    raise_at: RaiseAt | None = None  # user code raises in training_step
    kill_at: KillAt | None = None  # a rank is killed (or stopped)
    sigterm_at: SigtermAt | None = None  # a rank signals itself a preemption notice
    late_start: LateStart | None = None  # an elastic member starts its fit late (a loaded machine)
    joiner_dies_at_admission: bool = False  # the first elastic joiner (or spare) admitted is SIGKILLed as it receives the state
    dies_joining_group: DiesJoiningGroup | None = None  # a member lost as a generation's group forms
    signals: tuple[Signal, ...] = ()  # SIGTERMs to one rank or to all
    collective_fault: CollectiveFault | None = None  # a rank SIGKILLed before / inside its nth matching collective
    checkpoint_io: CheckpointIOFaults | None = None  # rank 0's checkpoint writes fail or are slow
    # each rank notes in crash_rank<r>.json what that checkpoint covers
    crash_after_checkpoints: int | None = None  # every rank exits (17, no cleanup) right after its kth checkpoint
    # checkpoints and resuming
    checkpoint_every_n_steps: int | None = None  # a ModelCheckpoint every N (DDP-equivalent) steps, all kept
    checkpoint_save_last: bool | Literal["link"] = False  # that ModelCheckpoint also saves last.ckpt (or links it)
    single_file_checkpoints: bool = False  # earlier versions' layout: every rank's states gathered into the one file
    checkpoint_monitor: CheckpointMonitor | None = None  # a ModelCheckpoint at each epoch's end
    checkpoint_every_s: float | None = None  # ModelCheckpoint(train_time_interval=...) in <out>/checkpoints/timed
    early_stopping: EarlyStopping | None = None  # an EarlyStopping callback
    save_in_step: int | None = None  # training_step saves inside_window.ckpt at this batch index (mid-window)
    ckpt_path: str | None = None  # trainer.fit(ckpt_path=...): resume from this checkpoint
    weights_only: bool | None = None  # trainer.fit(weights_only=...)
    # what is recorded
    trace: bool = True  # trace every torch.distributed collective (needed by collective_fault)
    record_params: bool = True  # record the initial and final parameter values (a wide model's are tens of MB)
    record_optimizer_state: bool = False  # record the optimizer's (and outer optimizer's) state at start and end
    record_logs: bool = False  # a logger that records every (metric, step) it is given, on every rank
    tensorboard: bool = False  # a TensorBoardLogger in <out>/tb instead (over record_logs)
    tensorboard_version: str | int | None = ""  # its version (None: version_0, version_1...)
    # a CSVLogger in <out>/csv (version_0...), W&B offline in <out>/wandb, MLflow with a file store in <out>/mlruns
    run_loggers: tuple[Literal["csv", "wandb", "mlflow"], ...] = ()  # loggers that keep a run, beside the one above
    lr_monitor: bool = False  # a LearningRateMonitor (with a logger)
    log_every_n_steps: int = 50  # Trainer(log_every_n_steps=...)
    progress_bar: bool = False  # Trainer(enable_progress_bar=...)

    def _check(self, where: str) -> None:
        if self.dataset == "litdata" and self.litdata_dir is None and not (self.litdata_combined or self.litdata_parallel):
            raise ValueError(
                "scenario key 'litdata_dir' (or 'litdata_combined', 'litdata_parallel') is needed with dataset='litdata'"
            )
        for rank, override in self.per_rank.items():
            inner = f"{where}.per_rank[{rank}]" if where else f"per_rank[{rank}]"
            for key in ("out", "per_rank"):
                if key in override:
                    raise ValueError(f"scenario key {key!r} cannot be overridden per rank ({inner})")
            self.for_rank(rank, where=inner)  # its keys known, its values valid

    def __post_init__(self) -> None:
        # the overrides kept as JSON data (a partial kill_at, say, is only whole once laid over the base)
        if isinstance(self.per_rank, Mapping):
            object.__setattr__(self, "per_rank", {rank: _plain(override) for rank, override in self.per_rank.items()})
        super().__post_init__()

    def for_rank(self, rank: int, where: str = "") -> ScenarioConfig:
        """This config with ``per_rank[rank]`` laid over it (mappings merged one level deep), without
        ``per_rank`` (spent)."""
        base = {key: value for key, value in self.to_dict().items() if key != "per_rank"}
        for key, value in thaw(self.per_rank.get(rank, {})).items():
            merged = isinstance(value, Mapping) and isinstance(base.get(key), Mapping)
            base[key] = {**base[key], **value} if merged else value
        return ScenarioConfig.from_dict(base, where=where or f"per_rank[{rank}]")

    def to_json(self) -> str:
        """The JSON a scenario process receives: the keys that differ from their defaults."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ScenarioConfig:
        return cls.from_dict(json.loads(text))
