"""Goodput when ranks die: torchrun ``--max-restarts`` and the last consensus checkpoint.

    python benchmarks/goodput.py            # 3 repeats, a rank killed after 12 s of training
    python benchmarks/goodput.py --quick    # 1 repeat, one kill after 4 s of training
    python benchmarks/goodput.py --smoke --json /tmp/goodput.json   # a tiny job, one kill after 1 s

The baseline for elastic membership. Today a lost rank ends the attempt: torchrun tears the
other rank down, relaunches both, and they resume from ``last.ckpt`` (docs/resume.md, "A rank
that dies"). What that costs is the relaunch (interpreter, imports, rendezvous, the controller's
probe windows) and the work trained after the last checkpoint. This script measures it as

    goodput = useful samples/s under kills / samples/s of the same run without kills

Each repeat runs the same job twice, interleaved (the order rotated every repeat), with
``torchrun --standalone --nproc-per-node 2 --max-restarts K``: once undisturbed, once with the
driver SIGKILLing a rank (rank 1, then rank 0, alternately) of every attempt once it has trained
for ``--kill-every`` seconds (counted from its first batch, so a slow relaunch on a loaded machine
cannot starve the job; an attempt that has finished training is not killed). Rank 1 is made
``--slowdown`` times slower with ``lightning_elche.Slowdown``; ``ModelCheckpoint``
writes ``last.ckpt`` every ``--checkpoint-every`` cohort steps; every attempt calls
``fit(ckpt_path="last")``. The model is the small CNN of ``benchmarks/fashion.py`` (Adam), the data
the generated 28x28 images of ``benchmarks/dispatch.py``, so nothing is downloaded.

*Useful* samples are those whose training survived into the final model. Every rank writes, at
each checkpoint, the sample indices it trained since the previous one, and each attempt records
which checkpoint it resumed from (an attempt/save counter carried in the checkpoint). Following
that chain back from the attempt that finished gives exactly what the final model trained; the
script checks it covers every sample of every epoch once (exact coverage) and counts
epochs x samples as useful. Rates are over the whole job's wall time, launch to exit, so the
failure-free run pays one start-up and the other one per attempt. Results go to
``benchmarks/results/goodput.json`` (``goodput_quick.json`` with ``--quick``). A job that fails is
recorded as failed (JSON and tables), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as `python benchmarks/goodput.py` (torchrun too): import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import BenchmarkFailed, cell, conclude, results_path, run_in_session, write_atomically
from benchmarks.provenance import Failures, rotated, spread

SCRIPT = Path(__file__).resolve()
# one repeat of a job short enough to be quick and long enough for one kill to land
SMOKE = {"repeats": 1, "samples": 4096, "epochs": 2, "kill_every": 1.0, "max_kills": 1, "checkpoint_every": 4, "timeout": 240.0}


# --------------------------------------------------------------------------------------------
# The job: one attempt of one rank, started by torchrun.
# --------------------------------------------------------------------------------------------


def worker(folder: Path, config: dict[str, Any]) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    # Registered before the heavy imports: a failure can strike an attempt while it starts.
    write_atomically(folder / f"pid_a{attempt}_r{rank}.json", {"pid": os.getpid(), "t": time.time()})

    from collections import defaultdict

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.dispatch import IndexedImages
    from benchmarks.fashion import small_cnn
    from lightning_elche import ElCheStrategy, Slowdown

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_cnn()
            images = IndexedImages(config["samples"])
            self.data = TensorDataset(images.x, images.y, torch.arange(config["samples"]))
            self.trained: dict[int, list[int]] = defaultdict(list)  # since the last checkpoint

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.trained[self.current_epoch].extend(index.tolist())
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=config["batch_size"], shuffle=True)

    class Ledger(pl.Callback):
        """Cuts what this attempt trained at every checkpoint, and names the checkpoint it resumed from.

        The (attempt, save) pair travels inside the checkpoint, so a resumed attempt knows which
        of the earlier attempts' cuts its starting model holds, even when a kill landed between a
        cut and the file's write.
        """

        def __init__(self) -> None:
            self.saves = 0
            self.source: Optional[dict[str, int]] = None
            self.count = 0
            self.progress = open(folder / f"progress_a{attempt}_r{rank}.txt", "a", buffering=1)

        def state_dict(self) -> dict[str, int]:
            self.saves += 1  # Lightning asks for this just before on_save_checkpoint, on every rank
            return {"attempt": attempt, "save": self.saves}

        def load_state_dict(self, state_dict: dict[str, int]) -> None:
            self.source = dict(state_dict)

        def _cut(self, module: Module, name: str, trainer: pl.Trainer) -> None:
            record = {
                "trained": {str(e): v for e, v in module.trained.items()}, "global_step": trainer.global_step, "t": time.time(),
            }
            write_atomically(folder / name, record)
            module.trained.clear()

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            self._cut(pl_module, f"ckpt_a{attempt}_n{self.saves}_r{rank}.json", trainer)

        def on_train_start(self, trainer, pl_module) -> None:
            write_atomically(
                folder / f"started_a{attempt}_r{rank}.json",
                {"t": time.time(), "source": self.source, "global_step": trainer.global_step},
            )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.count += len(batch[0])
            self.progress.write(f"{time.time():.3f} {self.count}\n")

        def on_train_end(self, trainer, pl_module) -> None:
            self._cut(pl_module, f"final_a{attempt}_r{rank}.json", trainer)

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ElCheStrategy(timeout=config["elche_timeout"]),
        max_epochs=config["epochs"],
        callbacks=[
            Slowdown({1: config["slowdown"]}),
            Ledger(),
            ModelCheckpoint(
                dirpath=folder / "checkpoints", every_n_train_steps=config["checkpoint_every"],
                save_top_k=0, save_last=True,
            ),
        ],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(Module(), ckpt_path="last")
    except BaseException as error:  # the survivor of a kill: when it gave up, and what it said
        write_atomically(folder / f"raised_a{attempt}_r{rank}.json", {"t": time.time(), "error": f"{type(error).__name__}: {error}"[:800]})
        raise


# --------------------------------------------------------------------------------------------
# The driver.
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _attempts(folder: Path) -> list[int]:
    return sorted({int(p.name.split("_")[1][1:]) for p in folder.glob("pid_a*_r*.json")})


def _kill_one(folder: Path, killed: list[dict[str, Any]], after_s: float) -> Optional[dict[str, Any]]:
    """SIGKILL one rank of the newest attempt once it has trained ``after_s`` seconds.

    Counted from the attempt's first batch, not from the previous kill: on a loaded machine a
    relaunch takes tens of seconds, and a wall-clock schedule would then kill every attempt as it
    starts, measuring the load rather than the failure path.
    """
    attempts = _attempts(folder)
    if not attempts or any(k["attempt"] == attempts[-1] for k in killed):
        return None
    attempt = attempts[-1]
    rank = 1 if len(killed) % 2 == 0 else 0
    pid_file = folder / f"pid_a{attempt}_r{rank}.json"
    if not pid_file.exists() or list(folder.glob(f"final_a{attempt}_r*.json")):
        return None
    first_batch = _first_batch(folder, attempt, rank)
    if first_batch is None or time.time() < first_batch + after_s:
        return None
    try:
        os.kill(_read(pid_file)["pid"], signal.SIGKILL)
    except ProcessLookupError:
        return None
    return {"t": time.time(), "attempt": attempt, "rank": rank}


def _first_batch(folder: Path, attempt: int, rank: int) -> Optional[float]:
    path = folder / f"progress_a{attempt}_r{rank}.txt"
    if not path.exists():
        return None
    with open(path) as f:
        line = f.readline().split()
    return float(line[0]) if len(line) == 2 else None


def _trained(folder: Path, attempt: int, rank: int) -> int:
    """Samples one rank trained in one attempt, kept or lost."""
    path = folder / f"progress_a{attempt}_r{rank}.txt"
    lines = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    counts = [int(line[1]) for line in lines if len(line) == 2]
    return counts[-1] if counts else 0


def _earliest(folder: Path, pattern: Optional[str], attempt: int) -> Optional[float]:
    """The earlier of the two ranks' times in a record, or their first batch (pattern None)."""
    if pattern is None:
        times = [_first_batch(folder, attempt, r) for r in range(2)]
    else:
        paths = [folder / pattern.format(a=attempt, r=r) for r in range(2)]
        times = [_read(path)["t"] for path in paths if path.exists()]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def failure_phases(folder: Path, killed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where each failure's time went, and what the surviving rank said.

    Until the survivor's fit raises (gloo's error, then ElChe's roll call naming the lost rank),
    until torchrun has relaunched (the survivor's exit, the agent's restart, the new
    interpreters), the new processes' start-up (imports, Trainer, process group, checkpoint
    load), and the wait for their first batch.
    """
    phases = []
    for hit in killed:
        nxt, survivor = hit["attempt"] + 1, folder / f"raised_a{hit['attempt']}_r{1 - hit['rank']}.json"
        launch, train = _earliest(folder, "pid_a{a}_r{r}.json", nxt), _earliest(folder, "started_a{a}_r{r}.json", nxt)
        first = _earliest(folder, None, nxt)
        raised = _read(survivor) if survivor.exists() else None
        if raised is None or None in (launch, train, first):
            continue
        phases.append({
            "survivor_raised_s": raised["t"] - hit["t"], "then_relaunch_s": launch - raised["t"],
            "start_up_s": train - launch, "to_first_batch_s": first - train, "kill_to_first_batch_s": first - hit["t"],
            "survivor_error": raised["error"],
        })
    return phases


def verify(folder: Path, samples: int, epochs: int) -> dict[str, Any]:
    """Rebuild what the final model trained from the attempts' cuts; check exact coverage."""
    attempts = _attempts(folder)
    finished = [a for a in attempts if all((folder / f"final_a{a}_r{r}.json").exists() for r in range(2))]
    if not finished:
        raise BenchmarkFailed(f"no attempt finished training (attempts {attempts}); see {folder / 'torchrun.log'}")
    attempt, pieces, cut = finished[-1], [], None
    chain = []
    while attempt is not None:
        names = [f"final_a{attempt}_r{r}.json" for r in range(2)] if cut is None else []
        last_save = cut if cut is not None else max(
            [int(p.name.split("_")[2][1:]) for p in folder.glob(f"ckpt_a{attempt}_n*_r0.json")], default=0
        )
        names += [f"ckpt_a{attempt}_n{n}_r{r}.json" for n in range(1, last_save + 1) for r in range(2)]
        for name in names:
            if not (folder / name).exists():
                raise BenchmarkFailed(
                    f"coverage not verifiable: {folder / name} is missing (a kill between the ranks' records of one checkpoint?)"
                )
            pieces.append(_read(folder / name))
        chain.append({"attempt": attempt, "through_save": cut})
        sources = [_read(folder / f"started_a{attempt}_r{r}.json")["source"] for r in range(2)]
        if sources[0] != sources[1]:
            raise BenchmarkFailed(f"attempt {attempt}: the ranks resumed from different checkpoints {sources}")
        if sources[0] is None:
            attempt = None
        else:
            attempt, cut = sources[0]["attempt"], sources[0]["save"]
    report: dict[str, Any] = {"chain": chain[::-1], "exact": True, "epochs": {}}
    for epoch in range(epochs):
        counts = Counter(i for piece in pieces for i in piece["trained"].get(str(epoch), []))
        duplicates = sum(1 for c in counts.values() if c > 1)
        missing = samples - len(set(counts) & set(range(samples)))
        report["epochs"][epoch] = {"duplicates": duplicates, "missing": missing}
        report["exact"] &= duplicates == 0 and missing == 0
    extra = sorted({e for piece in pieces for e in piece["trained"]} - {str(e) for e in range(epochs)})
    if extra:
        report["exact"] = False
        report["extra_epochs"] = extra
    return report


def run_job(args: argparse.Namespace, kill: bool) -> dict[str, Any]:
    """One job in a folder of its own, removed after a success (kept, and named in the error, after a failure)."""
    folder = Path(tempfile.mkdtemp(prefix=f"elche-goodput-{'with_kills' if kill else 'failure_free'}-"))
    config = {
        "samples": args.samples, "epochs": args.epochs, "batch_size": args.batch_size, "slowdown": args.slowdown,
        "checkpoint_every": args.checkpoint_every, "elche_timeout": args.elche_timeout,
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={args.max_restarts}",
        str(SCRIPT), "--worker", str(folder), json.dumps(config),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    killed: list[dict[str, Any]] = []

    def kill_when_due() -> None:
        if kill and (args.max_kills is None or len(killed) < args.max_kills):
            hit = _kill_one(folder, killed, args.kill_every)
            if hit is not None:
                killed.append(hit)

    started = time.time()  # the launch, give or take the Popen
    wall = run_in_session(
        command, folder / "torchrun.log", env, args.timeout, kill_when_due,
        lambda: f"torchrun after {len(killed)} kills (more than --max-restarts {args.max_restarts}?)",
    )
    coverage = verify(folder, args.samples, args.epochs)
    if not coverage["exact"]:
        raise BenchmarkFailed(f"coverage is not exact: {coverage}; the job's files are in {folder}")
    attempts = _attempts(folder)
    trained = sum(_trained(folder, a, r) for a in attempts for r in range(2))
    useful = args.samples * args.epochs
    first, ended = _earliest(folder, None, 0), _earliest(folder, "final_a{a}_r{r}.json", attempts[-1])
    phases = failure_phases(folder, killed)
    shutil.rmtree(folder)
    return {
        "wall_s": wall,
        "useful_samples": useful,
        "samples_per_s": useful / wall,
        "trained_samples": trained,
        "lost_samples": trained - useful,
        "attempts": len(attempts),
        "kills": [{"after_s": round(k["t"] - started, 2), "attempt": k["attempt"], "rank": k["rank"]} for k in killed],
        "failures": phases,
        "launch_to_first_batch_s": first - started if first else None,
        "train_end_to_exit_s": started + wall - ended if ended else None,
        "coverage_chain": coverage["chain"],
    }


def measure(args: argparse.Namespace, failures: Failures) -> list[dict[str, Any]]:
    """Both jobs in every repeat, in an order rotated every repeat; goodput where both ran."""
    repeats = []
    for repeat in range(args.repeats):
        figures: dict[str, Any] = {}
        for name in rotated(["failure_free", "with_kills"], repeat):
            figures[name] = failures.attempt(name, repeat, lambda: run_job(args, kill=name == "with_kills"))
        clean, faulty = figures["failure_free"], figures["with_kills"]
        if clean and faulty:
            figures["goodput"] = faulty["samples_per_s"] / clean["samples_per_s"]
            print(
                f"repeat {repeat + 1}: failure-free {clean['samples_per_s']:.0f} samples/s ({clean['wall_s']:.1f} s); "
                f"with kills {faulty['samples_per_s']:.0f} useful samples/s ({faulty['wall_s']:.1f} s, "
                f"{len(faulty['kills'])} kills, {faulty['attempts']} attempts, {faulty['lost_samples']} samples "
                f"trained and lost); goodput {figures['goodput']:.2f}; coverage exact in both",
                flush=True,
            )
        if faulty and not faulty["kills"]:
            print(f"repeat {repeat + 1}: no kill landed, training ended within --kill-every {args.kill_every:g} s: "
                  "lower it or raise --samples / --epochs", file=sys.stderr)
        figures["load_average_after"] = os.getloadavg()
        repeats.append(figures)
    return repeats


PHASES = {
    "survivor_raised_s": "kill -> the survivor's `fit` raises (gloo's error, then ElChe's roll call)",
    "then_relaunch_s": "-> torchrun has relaunched (survivor's exit, agent's restart, new interpreters)",
    "start_up_s": "-> training starts (imports, Trainer, process group, checkpoint load)",
    "to_first_batch_s": "-> first batch",
    "kill_to_first_batch_s": "kill -> first batch of the next attempt",
}


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def over(values: list[float]) -> Optional[dict[str, float]]:
        return spread(values) if values else None

    clean = [r["failure_free"] for r in repeats if r["failure_free"]]
    faulty = [r["with_kills"] for r in repeats if r["with_kills"]]
    phases = [f for job in faulty for f in job["failures"]]
    return {
        "goodput": over([r["goodput"] for r in repeats if "goodput" in r]),
        "failure_free_samples_per_s": over([job["samples_per_s"] for job in clean]),
        "useful_samples_per_s_with_kills": over([job["samples_per_s"] for job in faulty]),
        "kills": over([len(job["kills"]) for job in faulty]),
        "lost_samples": over([job["lost_samples"] for job in faulty]),
        "per_failure": {phase: spread([f[phase] for f in phases]) for phase in PHASES} if phases else None,
        "failure_free_launch_to_first_batch_s": over([job["launch_to_first_batch_s"] for job in clean if job["launch_to_first_batch_s"]]),
        "failure_free_train_end_to_exit_s": over([job["train_end_to_exit_s"] for job in clean if job["train_end_to_exit_s"]]),
    }


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``repeats``: each repeat's rates, goodput, kills and lost samples, then their median and range;
    ``phases``: where one failure's time goes, median (min-max) over every kill."""
    results = record["results"]
    summary = results["summary"]

    def of(job: Optional[dict[str, Any]], key: str, spec: str) -> str:
        if job is None:
            return "failed"
        return format(len(job[key]) if key == "kills" else job[key], spec)

    lines = [
        "| repeat | failure-free samples/s | useful samples/s with kills | goodput | kills | samples trained and lost |",
        "|---|---|---|---|---|---|",
    ]
    for i, figures in enumerate(results["repeats"]):
        clean, faulty = figures["failure_free"], figures["with_kills"]
        goodput = f"{figures['goodput']:.2f}" if "goodput" in figures else "-"
        lines.append(f"| {i + 1} | {of(clean, 'samples_per_s', '.0f')} | {of(faulty, 'samples_per_s', '.0f')} | {goodput} "
                     f"| {of(faulty, 'kills', 'd')} | {of(faulty, 'lost_samples', 'd')} |")
    columns = (("failure_free_samples_per_s", ".0f"), ("useful_samples_per_s_with_kills", ".0f"), ("goodput", ".2f"),
               ("kills", "g"), ("lost_samples", ".0f"))
    for label, stats in (("median", ("median",)), ("min / max", ("min", "max"))):
        cells = ["-" if summary[key] is None else " / ".join(format(summary[key][s], spec) for s in stats) for key, spec in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    phases = ["| phase | seconds |", "|---|---|"]
    per_failure = summary["per_failure"] or {}
    phases += [f"| {label} | {cell(per_failure.get(phase), '.1f')} |" for phase, label in PHASES.items()]
    phases += [f"| failure-free job: launch -> first batch | {cell(summary['failure_free_launch_to_first_batch_s'], '.1f')} |",
               f"| failure-free job: last batch -> exit | {cell(summary['failure_free_train_end_to_exit_s'], '.1f')} |"]
    return {"repeats": "\n".join(lines) + "\n", "phases": "\n".join(phases) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of a shorter job with one kill, after 4 s of training")
    parser.add_argument("--smoke", action="store_true", help="1 repeat of a tiny job with one kill, after 1 s of training")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--samples", type=int, default=None, help="training samples per epoch; default 24576 (8192 with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 (2 with --quick)")
    parser.add_argument(
        "--kill-every", type=float, default=None,
        help="seconds of an attempt's training before a rank is killed; default 12 (4 with --quick)",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=20,
        help="cohort steps between checkpoints (last.ckpt): several must fit in --kill-every, or attempts keep nothing",
    )
    parser.add_argument("--max-kills", type=int, default=None, help="kills per job at most; default no limit (1 with --quick)")
    parser.add_argument("--max-restarts", type=int, default=20, help="torchrun --max-restarts; must exceed the kills")
    parser.add_argument("--slowdown", type=float, default=2.0, help="rank 1 is this many times slower")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--elche-timeout", type=float, default=60, help="ElCheStrategy(timeout=...)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one job may take before it is ended as hung")
    parser.add_argument(
        "--json", type=Path, default=None, help="results file; default benchmarks/results/goodput.json (goodput_quick.json with --quick)",
    )
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    defaults = {"repeats": (3, 1), "samples": (24576, 8192), "epochs": (3, 2), "kill_every": (12.0, 4.0), "max_kills": (None, 1)}
    for name, (full, short) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    args.json = results_path("goodput", args)
    if args.max_kills is not None and args.max_kills < 0:
        parser.error(f"--max-kills must be 0 or more, got {args.max_kills}")
    for name in ("repeats", "samples", "epochs", "checkpoint_every", "max_restarts", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.kill_every <= 0:
        parser.error(f"--kill-every must be a positive number of seconds, got {args.kill_every}")
    if args.slowdown < 1:
        parser.error(f"--slowdown must be at least 1 (rank 1 this many times slower), got {args.slowdown}")

    failures = Failures()
    repeats = measure(args, failures)
    print(f"\nuseful samples/s with a rank SIGKILLed after {args.kill_every:g} s of each attempt's training, over failure-free samples/s "
          f"({'' if args.max_kills is None else f'at most {args.max_kills} kills per job, '}"
          f"torchrun --max-restarts {args.max_restarts}, checkpoint every {args.checkpoint_every} cohort steps, "
          f"rank 1 {args.slowdown:g}x slower, {args.epochs} epochs x {args.samples} samples)")
    conclude("goodput", args, {"repeats": repeats, "summary": summarize(repeats)}, failures, tables)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
