"""Goodput of an elastic cohort: a rank SIGKILLed every 30 s and replaced, beside the same fit undisturbed
and beside torchrun's restart from the last checkpoint.

    python -m benchmarks.elastic_goodput            # 2 repeats (--repeats 3 for the figures) of ~4-minute fits, 3 ranks
    python -m benchmarks.elastic_goodput --quick    # 1 repeat of a ~1-minute fit
    python -m benchmarks.elastic_goodput --smoke --json /tmp/elastic_goodput.json   # two ranks, a fit of seconds, one kill

Each repeat runs one job three ways, in an order rotated every repeat:

- ``failure_free``: ``python -m lightning_elche.launch --nproc 3`` with ``ElCheStrategy(elastic=True)``;
- ``elastic``: the same launch with ``--replace --spares 1``, the driver SIGKILLing a member every
  ``--kill-every`` seconds (the leader and the newest member in turn); the survivors go on, the spare
  takes the lost member's place at the next boundary and the launcher starts a new spare;
- ``restart``: ``torchrun --max-restarts`` with ``ElCheStrategy()`` (not elastic), ``last.ckpt`` every
  ``--checkpoint-every`` cohort steps and ``fit(ckpt_path="last")``, a rank of every attempt SIGKILLed
  once it has trained ``--kill-every`` seconds (the path docs/resume.md describes, and the one
  ``benchmarks/goodput.py`` measures in detail, coverage chain included).

``--dispatch`` and ``--outer`` (DiLoCo's outer Nesterov step) set the strategy of every way; with
``--idle-slowdown F`` the run ends with failure-free fits, member 1 F times slower, under planned and
under dynamic dispatch: rank 0's share of the training span spent waiting at boundaries for it.

goodput = (epochs x samples) / time, over the failure-free run's: the time from launch to exit (start-up
and teardown, paid once by each way, included) and the training span (first batch to last), the
stricter figure.

The job: Fashion-MNIST (``apt-get install -y dataset-fashion-mnist``), an MLP, Adam, batch 64 per rank.
Every step also sleeps ``--accelerator-ms``: the time an accelerator would compute while its host
waits. With it, three ranks on this two-core machine do not compete for the CPU, so a lost rank costs
its throughput as it would on a rig of three GPUs (CPU-bound ranks would instead speed up when one of
them dies), and a replacement's start-up (imports, Trainer) has a core to run on.

What the elastic run trained is checked from a ledger: before each boundary a member appends the
window it trained (with the generation and cohort step the window started from), and after it the
members whose windows that boundary averaged. A window counts when some member recorded it averaged;
a killed member's last window, or the part of it it trained, counts only then. The counted windows must
hold every sample of every epoch exactly once. The final model (written by the leader at the end) is
evaluated on the 10,000 test images: final accuracy against the failure-free run's.
Results go to ``benchmarks/results/elastic_goodput.json`` (``elastic_goodput_quick.json`` with ``--quick``).
A way that fails is recorded as failed (JSON and table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

if __package__ in (None, ""):  # run as `python benchmarks/elastic_goodput.py` (its ranks too): import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import BenchmarkFailed, cell, conclude, failed, results_path, run_in_session, write_atomically
from benchmarks.provenance import Failures, rotated, spread

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
WAYS = ("failure_free", "elastic", "restart")
# every way once, on two ranks and a fit of seconds (8 epochs of the 1,437 digits, about 5 s of training
# unloaded) with one kill in it, a second into the training, so that the replacement comes in before its end
SMOKE = {"data": "digits", "repeats": 1, "ranks": 2, "samples": 16384, "epochs": 8, "kill_every": 1.0, "max_kills": 1,
         "checkpoint_every": 8, "timeout": 240.0, "dispatch": "dynamic", "outer": True, "idle_slowdown": 3.0}


# --------------------------------------------------------------------------------------------
# The job: one rank, started by lightning_elche.launch or torchrun.
# --------------------------------------------------------------------------------------------


JOB_OPTIONS = {"dispatch": "auto", "outer": False, "slow": {}}  # the strategy options a job's caller may leave out (fault_sweep's)


def worker(folder: Path, config: dict[str, Any]) -> None:
    config = {**JOB_OPTIONS, **config}
    elastic = config["way"] != "restart"
    name = f"m{os.environ['ELCHE_MEMBER_ID']}" if elastic else f"a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}_r{os.environ['RANK']}"
    write_atomically(folder / f"pid_{name}.json", {"pid": os.getpid(), "t": time.time()})  # before the imports: a kill may come early

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.fashion import load_data
    from lightning_elche import ElCheStrategy, OuterNesterov, Slowdown

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            train, _ = load_data(config["data"])
            self.net = mlp(train.tensors[0][0].numel())
            images, labels = (t[: config["samples"]] for t in train.tensors)
            self.data = TensorDataset(images, labels, torch.arange(len(labels)))
            self.window: dict[int, list[int]] = defaultdict(list)  # trained since the last boundary

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.window[self.current_epoch].extend(index.tolist())
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            time.sleep(config["accelerator_ms"] / 1000)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=config["batch_size"], shuffle=True)

    class Ledger(pl.Callback):
        """One line per window before its boundary, one after it: see the module's docstring."""

        def __init__(self) -> None:
            self.lines = open(folder / f"ledger_{name}.jsonl", "a", buffering=1)
            self.first_batch = False

        def _note(self, record: dict[str, Any]) -> None:
            self.lines.write(json.dumps(record) + "\n")

        def on_train_start(self, trainer, pl_module) -> None:
            strategy = trainer.strategy
            if not elastic or getattr(strategy.callback, "_ledgered", False):
                return
            run_boundary, run_after_boundary = strategy.callback._boundary, strategy.world.after_boundary
            exchanged: list[Any] = []  # the members whose exchange committed, as the boundary goes on past it

            def ledgered_boundary(trainer, cohort):
                key = [strategy.world.membership.current.number, cohort.cohort_step]
                self._note({"window": key, "trained": {str(e): v for e, v in pl_module.window.items()}, "t": time.time()})
                pl_module.window.clear()
                exchanged.clear()
                run_boundary(trainer, cohort)
                # The members that averaged the window: those of the committed exchange (a member lost after it,
                # as joiners are admitted, had its window in the consensus), else of the survivors' redo.
                members = exchanged[0] if exchanged else list(strategy.world.membership.current.members)
                self._note({"averaged": key, "members": members, "t": time.time()})

            def noted_after_boundary(session, control, checkpoints):
                exchanged.append(list(strategy.world.membership.current.members))
                run_after_boundary(session, control, checkpoints)

            strategy.callback._boundary, strategy.callback._ledgered = ledgered_boundary, True
            strategy.world.after_boundary = noted_after_boundary

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not self.first_batch:
                self.first_batch = True
                write_atomically(folder / f"first_batch_{name}.json", {"t": time.time()})

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                torch.save(pl_module.net.state_dict(), folder / "final_model.pt")
            untrained = sum(map(len, pl_module.window.values()))
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in pl_module.net.parameters())).hexdigest()
            final = {"t": time.time(), "untrained_window": untrained, "digest": digest}
            if trainer.global_rank == 0:
                final["waited_s"] = waited_s(trainer.strategy.boundaries)
            write_atomically(folder / f"final_{name}.json", final)

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = [Ledger()]
    if config["slow"]:  # steps that sleep (the accelerator's compute) are slowed on the wall clock
        callbacks.append(Slowdown({int(rank): factor for rank, factor in config["slow"].items()}, clock="wall"))
    if not elastic:
        callbacks.append(ModelCheckpoint(dirpath=folder / "checkpoints", every_n_train_steps=config["checkpoint_every"],
                                         save_top_k=0, save_last=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=config["ranks"], max_epochs=config["epochs"], callbacks=callbacks,
        strategy=ElCheStrategy(elastic=elastic, timeout=config["elche_timeout"], dispatch=config["dispatch"],
                               outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9, nesterov=True) if config["outer"] else None),
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Module(), ckpt_path=None if elastic else "last")


def waited_s(boundaries: list[Any]) -> float:
    """Seconds rank 0 waited at boundaries for the last rank to arrive: at each boundary, its time there
    over the shortest of the others' (every rank's, carried to the next boundary), as
    ``benchmarks/dispatch.py`` measures the fast rank's idle share."""
    waits = [mine - min(others) for record in boundaries if len(record.previous_boundary_ms) > 1
             for mine, *others in [record.previous_boundary_ms]]  # the first boundary has none before it
    return sum(max(0.0, wait) for wait in waits) / 1000.0


def mlp(features: int) -> "torch.nn.Module":
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


# --------------------------------------------------------------------------------------------
# The driver.
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _started(folder: Path) -> Optional[float]:
    """The fit's first batch (any rank's)."""
    times = [_read(p)["t"] for p in folder.glob("first_batch_*.json")]
    return min(times) if times else None


def _victim(folder: Path, way: str, killed: list[dict[str, Any]]) -> Optional[tuple[str, int]]:
    """Who dies next. Elastic: a member that has trained (the leader, then the newest, in turn), not one
    killed before, never the last one alive (a fit needs one to carry its state: with none left it ends with
    its members' error, docs/elastic.md; at a kill every 15 s the spares' admissions, one window each, can
    fall behind). Restart: a rank of the newest attempt that has trained, once per attempt."""
    dead = {k["name"] for k in killed}
    trained = sorted((p.name[len("first_batch_"):-len(".json")] for p in folder.glob("first_batch_*.json")),
                     key=lambda n: [int(part[1:]) for part in n.split("_")])
    if way == "elastic":
        alive = [n for n in trained if n not in dead and not (folder / f"final_{n}.json").exists()]
        if len(alive) < 2:
            return None
        name = alive[0] if len(killed) % 2 == 0 else alive[-1]
    else:
        attempts = sorted({int(n.split("_")[0][1:]) for n in trained})
        if not attempts or any(k["name"].startswith(f"a{attempts[-1]}_") for k in killed):
            return None
        name = f"a{attempts[-1]}_r{1 if len(killed) % 2 == 0 else 0}"
        if name not in trained or list(folder.glob(f"final_a{attempts[-1]}_*.json")):
            return None
    return name, _read(folder / f"pid_{name}.json")["pid"]


def run(
    args: argparse.Namespace, way: str, folder: Path, dispatch: Optional[str] = None, slow: Optional[dict[str, float]] = None
) -> dict[str, Any]:
    config = {
        "way": way, "data": args.data, "ranks": args.ranks, "samples": args.samples, "epochs": args.epochs, "batch_size": args.batch_size,
        "accelerator_ms": args.accelerator_ms, "checkpoint_every": args.checkpoint_every, "elche_timeout": args.elche_timeout,
        "dispatch": dispatch or args.dispatch, "outer": args.outer, "slow": slow or {},
    }
    worker_args = [str(SCRIPT), "--worker", str(folder), json.dumps(config)]
    if way == "restart":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                   f"--max-restarts={args.max_kills + 1}", *worker_args]
    else:
        command = [sys.executable, "-m", "lightning_elche.launch", "--nproc", str(args.ranks), "--exit-grace", "20",
                   *(["--replace", "--max-replacements", str(args.max_kills), "--spares", str(args.spares)]
                     if way == "elastic" else []), *worker_args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    killed: list[dict[str, Any]] = []

    def kill_when_due() -> None:
        started = _started(folder)
        if way == "failure_free" or started is None or len(killed) >= args.max_kills:
            return
        due = (started if way == "elastic" else _attempt_start(folder, killed)) + args.kill_every * (
            len(killed) + 1 if way == "elastic" else 1)
        victim = _victim(folder, way, killed) if time.time() >= due else None
        if victim is not None:
            try:
                os.kill(victim[1], signal.SIGKILL)
                killed.append({"name": victim[0], "after_s": round(time.time() - launched, 2)})
            except ProcessLookupError:
                pass

    launched = time.time()  # give or take the Popen
    wall = run_in_session(command, folder / "launch.log", env, args.timeout, kill_when_due, lambda: f"{way} after {len(killed)} kills")
    useful = args.samples * args.epochs
    ended = max(_read(p)["t"] for p in folder.glob("final_*.json"))
    figures = {
        "wall_s": wall, "samples_per_s": useful / wall, "training_s": ended - started_at(folder),
        "training_samples_per_s": useful / (ended - started_at(folder)), "kills": killed,
        "replacements_training_after_s": replacement_delays(folder, killed, args.ranks, launched) if way == "elastic" else [],
        "kill_costs": kill_costs(folder, killed, launched, args.ranks) if way == "elastic" else None,
        "accuracy": accuracy(folder / "final_model.pt", args.data),
    }
    if way == "failure_free":  # no kill: rank 0 is the same process from the first boundary to the last
        figures["rank0_idle"] = _read(folder / "final_m0.json")["waited_s"] / figures["training_s"]
    if way != "restart":
        figures["coverage"] = verify_ledger(folder, args.samples, args.epochs)
        if not figures["coverage"]["exact"]:
            raise BenchmarkFailed(f"{way}: coverage is not exact: {figures['coverage']}; files in {folder}")
    return figures


def started_at(folder: Path) -> float:
    started = _started(folder)
    assert started is not None
    return started


def replacement_delays(folder: Path, killed: list[dict[str, Any]], ranks: int, launched: float) -> list[float]:
    """Seconds from each kill to the first batch of the member that took the place: the first newcomer's
    first batch after the kill that no earlier kill took (kills faster than admissions leave the rest
    without one; pairing them in order instead gave a negative delay at a kill every 15 s)."""
    joined = sorted(_read(p)["t"] - launched for p in folder.glob("first_batch_m*.json")
                    if int(p.name[len("first_batch_m"):-len(".json")]) >= ranks)
    delays, next_join = [], 0
    for kill in killed:
        while next_join < len(joined) and joined[next_join] < kill["after_s"]:
            next_join += 1
        if next_join == len(joined):
            break
        delays.append(round(joined[next_join] - kill["after_s"], 2))
        next_join += 1
    return delays


def _attempt_start(folder: Path, killed: list[dict[str, Any]]) -> float:
    """The newest attempt's first batch (the restart path kills each attempt once it has trained a while)."""
    attempts = [int(p.name.split("_")[2][1:]) for p in folder.glob("first_batch_a*_r*.json")]
    newest = max(attempts)
    return min(_read(p)["t"] for p in folder.glob(f"first_batch_a{newest}_r*.json"))


def verify_ledger(folder: Path, samples: int, epochs: int) -> dict[str, Any]:
    """Every sample of every epoch in exactly one averaged window (the module's docstring says how)."""
    windows, averaged = [], defaultdict(set)
    for member, record in _ledger(folder):
        if "window" in record:
            windows.append((member, tuple(record["window"]), record["trained"]))
        else:
            averaged[tuple(record["averaged"])].update(record["members"])
    counted = [trained for member, key, trained in windows if member in averaged[key]]
    report: dict[str, Any] = {"windows": len(windows), "counted": len(counted), "exact": True, "epochs": {}}
    for epoch in range(epochs):
        counts = Counter(i for trained in counted for i in trained.get(str(epoch), []))
        duplicates = sum(1 for c in counts.values() if c > 1)
        missing = samples - len(set(counts) & set(range(samples)))
        report["epochs"][epoch] = {"duplicates": duplicates, "missing": missing}
        report["exact"] &= duplicates == 0 and missing == 0
    return report


def kill_costs(folder: Path, killed: list[dict[str, Any]], launched: float, ranks: int) -> dict[str, Any]:
    """Where each kill's time went, from the ledgers' clock (one machine): the boundaries in the order the
    cohort closed them (a boundary's first "averaged" line), each interval over the median one (``window_s``).
    Per kill: ``shrink_s`` the extra time of the interval whose boundary found the loss (detection, the new
    group, the iterator restarted); ``short_handed_s`` from there to the boundary that admitted the
    replacement; ``admit_s`` that boundary's extra time (the checkpoint sent, the group of the larger world);
    ``first_window_s`` the next interval's extra time (the members wait for the newcomer's first window)."""
    closed: dict[tuple[int, int], tuple[float, int]] = {}
    for _, record in _ledger(folder):
        if "averaged" in record:
            key = tuple(record["averaged"])
            closed[key] = min(closed.get(key, (math.inf, 0)), (record["t"], len(record["members"])))
    timeline = sorted(closed.values())
    intervals = [b - a for (a, _), (b, _) in zip(timeline, timeline[1:])]
    window = statistics.median(intervals)
    extra = [0.0] + [interval - window for interval in intervals]  # extra[i]: the interval ending at boundary i, over a normal one
    costs = []
    for kill in killed:
        at = launched + kill["after_s"]
        shrink = next((i for i, (t, members) in enumerate(timeline) if t > at and members < ranks), None)
        admit = None if shrink is None else next((j for j in range(shrink + 1, len(timeline)) if timeline[j][1] == ranks), None)
        if admit is None or admit + 1 >= len(timeline):
            continue  # the fit ended before the replacement came in
        costs.append({"shrink_s": extra[shrink], "short_handed_s": timeline[admit][0] - timeline[shrink][0],
                      "admit_s": extra[admit], "first_window_s": extra[admit + 1]})
    return {"window_s": window, "per_kill": costs}


def _ledger(folder: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every member's ledger lines, as (member id, record); the line a kill cut short is skipped."""
    for path in folder.glob("ledger_m*.jsonl"):
        member = int(path.name[len("ledger_m"):-len(".jsonl")])
        for line in path.read_text().splitlines():
            try:
                yield member, json.loads(line)
            except json.JSONDecodeError:
                continue


def accuracy(model_file: Path, data: str) -> float:
    import torch

    from benchmarks.fashion import load_data

    _, test = load_data(data)
    net = mlp(test.tensors[0][0].numel())
    net.load_state_dict(torch.load(model_file))
    with torch.no_grad():
        return float((net(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean())


def predict(args: argparse.Namespace, summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The cohort simulator's goodput for this run (``lightning_elche.sim.elastic``), from inputs measured in
    it: the failure-free step time, and the time from a kill to the replacement's first batch."""
    from lightning_elche.sim.elastic import simulate_elastic

    clean, elastic = summary.get("failure_free", {}), summary.get("elastic", {})
    if "training_samples_per_s" not in clean or "kill_to_replacement_training_s" not in elastic:
        return None
    step_ms = 1000.0 * args.batch_size * args.ranks / clean["training_samples_per_s"]["median"]
    inputs = {"step_ms": round(step_ms, 2), "rejoin_s": elastic["kill_to_replacement_training_s"]["median"], "detect_s": 0.1}
    predicted = simulate_elastic(
        [1.0] * args.ranks, batch_size=args.batch_size, epochs=args.epochs, epoch_samples=args.samples,
        fail_every_s=args.kill_every, **inputs,
    )
    return {"inputs": inputs, "goodput": predicted.goodput, "failures": predicted.failures,
            "measured_training_goodput": elastic.get("training_goodput", {}).get("median")}


def run_way(args: argparse.Namespace, way: str, dispatch: Optional[str] = None, slow: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """One way in a folder of its own, removed after a success unless ``--keep-folders`` (kept, and named
    in the error, after a failure)."""
    folder = Path(tempfile.mkdtemp(prefix=f"elche-elastic-goodput-{way}-"))
    figures = run(args, way, folder, dispatch, slow)
    if args.keep_folders:
        print(f"{way}: run folder kept, {folder}", flush=True)
    else:
        shutil.rmtree(folder)
    print(f"{way}{f' ({dispatch} dispatch, {slow} slower)' if slow else ''}: "
          f"{figures['samples_per_s']:.0f} useful samples/s launch to exit ({figures['wall_s']:.0f} s), "
          f"{figures['training_samples_per_s']:.0f} over the training ({figures['training_s']:.0f} s), "
          f"{len(figures['kills'])} kills, accuracy {100 * figures['accuracy']:.2f} %", flush=True)
    return figures


def measure(args: argparse.Namespace, failures: Failures) -> list[dict[str, Any]]:
    """Every way in every repeat, in an order rotated every repeat; each against the failure-free run of its repeat."""
    repeats = []
    for repeat in range(args.repeats):
        figures = {way: failures.attempt(way, repeat, lambda: run_way(args, way)) for way in rotated(args.ways, repeat)}
        clean = figures["failure_free"]
        for way, done in figures.items():
            if way != "failure_free" and done and clean:
                done["goodput"] = done["samples_per_s"] / clean["samples_per_s"]
                done["training_goodput"] = done["training_samples_per_s"] / clean["training_samples_per_s"]
                done["accuracy_change_points"] = 100 * (done["accuracy"] - clean["accuracy"])
        repeats.append(figures)
    return repeats


IDLE_DISPATCHES = ("planned", "dynamic")


def measure_idle(args: argparse.Namespace, failures: Failures) -> Optional[dict[str, Any]]:
    """With ``--idle-slowdown F``: failure-free elastic fits with member 1 F times slower, planned against
    dynamic dispatch in an order rotated every repeat; rank 0's (a fast rank's) share of the training
    span spent waiting at boundaries for the slow one."""
    if args.idle_slowdown <= 1:
        return None
    slow = {"1": args.idle_slowdown}
    repeats = [
        {dispatch: failures.attempt(f"idle-{dispatch}", repeat, lambda: run_way(args, "failure_free", dispatch, slow))
         for dispatch in rotated(IDLE_DISPATCHES, repeat)}
        for repeat in range(args.repeats)
    ]
    summary = {
        dispatch: {key: spread([r[dispatch][key] for r in repeats if r.get(dispatch)])
                   for key in ("rank0_idle", "training_samples_per_s")}
        for dispatch in IDLE_DISPATCHES if any(r.get(dispatch) for r in repeats)
    }
    return {"slowdown": args.idle_slowdown, "repeats": repeats, "summary": summary}


def summarize(repeats: list[dict[str, Any]], ways: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for way in ways:
        done = [r[way] for r in repeats if r.get(way)]
        if not done:
            continue
        summary[way] = {"kills": spread([len(d["kills"]) for d in done])}
        for key in ("samples_per_s", "goodput", "training_samples_per_s", "training_goodput", "accuracy", "accuracy_change_points"):
            values = [d[key] for d in done if key in d]
            if values:
                summary[way][key] = spread(values)
        delays = [t for d in done for t in d.get("replacements_training_after_s", [])]
        if delays:
            summary[way]["kill_to_replacement_training_s"] = spread(delays)
        per_kill = [c for d in done if d.get("kill_costs") for c in d["kill_costs"]["per_kill"]]
        if per_kill:
            summary[way]["kill_costs"] = {part: spread([c[part] for c in per_kill]) for part in per_kill[0]}
    return summary


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``ways``: each way's rates and goodput (launch to exit and over the training span) and its final
    accuracy, medians (min-max) over the repeats; ``kills``: where a kill's time went, for the elastic way."""
    summary, args = record["results"]["summary"], record["args"]
    lines = [
        f"| run (medians of {args['repeats']}, min-max) | useful samples/s, training | goodput, training "
        "| useful samples/s, launch to exit | goodput, launch to exit | final accuracy | change, points |",
        "|---|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        row, lost = summary.get(way), failed(record, way)
        if row is None:
            if lost:
                lines.append(f"| {way} | failed ({lost} of {lost} runs) | | | | | |")
            continue
        kills = f"{row['kills']['min']:g}" + ("" if row["kills"]["min"] == row["kills"]["max"] else f"-{row['kills']['max']:g}")
        label = {"failure_free": "failure-free (elastic launch, no kill)", "elastic": f"elastic, {kills} kills, a spare takes each place",
                 "restart": f"torchrun restart from `last.ckpt`, {kills} kills"}[way]
        clean = way == "failure_free"
        lines.append(
            f"| {label}{f' ({lost} failed)' if lost else ''} | {cell(row.get('training_samples_per_s'), '.0f')} "
            f"| {'1' if clean else cell(row.get('training_goodput'))} | {cell(row.get('samples_per_s'), '.0f')} "
            f"| {'1' if clean else cell(row.get('goodput'))} | {cell(row.get('accuracy'), '.2f', 100, ' %')} "
            f"| {'' if clean else cell(row.get('accuracy_change_points'), '+.2f')} |"
        )
    out = {"ways": "\n".join(lines) + "\n"}
    elastic = summary.get("elastic", {})
    if "kill_to_replacement_training_s" in elastic:
        parts = {"kill_to_replacement_training_s": "a kill to the replacement's first batch", **KILL_COSTS}
        costs = {"kill_to_replacement_training_s": elastic["kill_to_replacement_training_s"], **elastic.get("kill_costs", {})}
        out["kills"] = "\n".join(["| elastic, each kill | seconds |", "|---|---|"] +
                                 [f"| {label} | {cell(costs.get(part), '.2f')} |" for part, label in parts.items()]) + "\n"
    idle = record["results"].get("idle")
    if idle:
        lines = [f"| failure-free, member 1 {idle['slowdown']:g}x slower (medians of {args['repeats']}, min-max) "
                 "| rank 0's idle share | useful samples/s, training |", "|---|---|---|"]
        for dispatch in IDLE_DISPATCHES:
            row = idle["summary"].get(dispatch)
            if row is None:
                lines.append(f"| {dispatch} dispatch | failed | |")
                continue
            idle_share, rate = cell(row["rank0_idle"], ".1f", 100, " %"), cell(row["training_samples_per_s"], ".0f")
            lines.append(f"| {dispatch} dispatch | {idle_share} | {rate} |")
        out["idle"] = "\n".join(lines) + "\n"
    return out


KILL_COSTS = {
    "shrink_s": "the boundary that finds the loss, over a normal window", "short_handed_s": "one rank short",
    "admit_s": "the boundary that admits the replacement, over a normal one",
    "first_window_s": "the newcomer's first window, over a normal one",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of a ~1-minute fit, a kill every 15 s")
    parser.add_argument("--smoke", action="store_true", help="every way once on a tiny fit with one kill: does everything run?")
    parser.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--data", choices=("fashion", "digits"), default="fashion",
                        help="digits: scikit-learn's bundled 1,437 training images, for a smoke run (too small to measure)")
    parser.add_argument("--samples", type=int, default=60000, help="training samples per epoch, at most the data's (Fashion-MNIST: 60,000)")
    parser.add_argument("--epochs", type=int, default=None, help="default 12 (4 with --quick)")
    parser.add_argument("--kill-every", type=float, default=None, help="seconds between kills; default 30 (15 with --quick)")
    parser.add_argument("--max-kills", type=int, default=20)
    parser.add_argument("--spares", type=int, default=1, help="elastic: lightning_elche.launch --spares")
    parser.add_argument("--accelerator-ms", type=float, default=40.0, help="sleep per step: the accelerator's compute")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="restart path: cohort steps between last.ckpt")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--elche-timeout", type=float, default=30, help="ElCheStrategy(timeout=...)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one job may take before it is ended as hung")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--dispatch", choices=("auto", "planned", "dynamic"), default="auto",
                        help="ElCheStrategy(dispatch=...) for every way (auto: dynamic, the default)")
    parser.add_argument("--outer", action="store_true",
                        help="ElCheStrategy(outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9)): DiLoCo's outer step")
    parser.add_argument("--idle-slowdown", type=float, default=0.0,
                        help="also measure rank 0's idle share in failure-free fits with member 1 this many times "
                             "slower, planned against dynamic dispatch (0: not measured)")
    parser.add_argument("--keep-folders", action="store_true",
                        help="keep every run's folder (ledgers, logs, checkpoints) after a success too, to read a slow one")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/elastic_goodput[_quick].json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    for name, full, short in (("repeats", 2, 1), ("epochs", 12, 4), ("kill_every", 30.0, 15.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    args.json = results_path("elastic_goodput", args)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (a kill must leave survivors), got {args.ranks}")
    if "failure_free" not in args.ways:
        parser.error("--ways must include failure_free: goodput is measured against it")

    from benchmarks.fashion import choose_data, load_data

    args.data = choose_data(args.data)
    train, _ = load_data(args.data)  # parsed and cached here once, not by every rank of the first launch at the same time
    args.samples = min(args.samples, len(train))
    failures = Failures()
    repeats = measure(args, failures)
    summary = summarize(repeats, args.ways)
    simulator = predict(args, summary)
    if simulator is not None:
        print(f"\nthe simulator (lightning_elche.sim.elastic) predicts a training goodput of {simulator['goodput']:.2f} "
              f"({simulator['failures']} failures) from inputs measured here: {simulator['inputs']}")
    idle = measure_idle(args, failures)
    results = {"repeats": repeats, "summary": summary, "simulator": simulator, "idle": idle, "load_average_after": os.getloadavg()}
    conclude("elastic_goodput", args, results, failures, tables)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
