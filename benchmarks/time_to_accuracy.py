"""Time to accuracy: does the second, slower device get a model to its target sooner than the fast
device alone, and sooner than the peers a user would pick instead? Three tasks, rank 1 slowed k
times, every configuration evaluated on its consensus model at a fixed sample interval.

    python -m benchmarks.time_to_accuracy                 # 3 tasks x k = 1, 2, 4 x 7 configurations x 3 repeats, whole fit: ~3 h 10 min
    python -m benchmarks.time_to_accuracy --quick         # every code path once, tiny (about 2 minutes; tests)
    python -m benchmarks.time_to_accuracy --report        # tables and plots again from the results JSON, no training
    python -m benchmarks.time_to_accuracy --report --target charlm=1.8   # ... at another target, from the kept curves
    python -m benchmarks.time_to_accuracy --tasks fashion --slowdowns 2 --repeats 1 --parts tasks

Tasks (``benchmarks/tta_tasks.py``): ``fashion`` (the small CNN on Fashion-MNIST, 3 epochs, test
accuracy), ``mlp`` (784-256-256-10 on the same images, 10 epochs, a step of a few ms as a GPU's),
``charlm`` (``examples/char_lm.py``'s GPT at half size, one pass, validation loss). Every
configuration trains the same samples with the same per-rank batch, optimizer and schedule, on two
rank processes on this machine's two cores (gloo, one thread each), rank 1 made k times slower by
``lightning_elche.Slowdown`` (in the plain loop, its ``StepStretcher``): it sleeps ``k - 1`` times the
training thread's CPU time of each step, so computation is k times slower and communication and
waiting are not, for every configuration alike.

Configurations (``CONFIGS``; ElChe's are spelled out in ``ELCHE`` and nowhere else):

  fast-alone      one process, the fast device alone on the whole data
  ddp             Lightning ``strategy="ddp"``
  torchft-diloco  torchft 0.2.0 ``DiLoCo``, the plain PyTorch loop it is written for
                  (``benchmarks/peers_torchft.py``'s set-up: sync every 16 inner steps, outer Nesterov
                  SGD lr 0.7, momentum 0.9, equal shards)
  elche           ``ElCheStrategy()``: the defaults (DiLoCo's outer step where speeds differ 1.5x or more)
  elche-plain     ``ElCheStrategy(outer_optimizer="none")``: plain averaging at every boundary (0.2's default)
  elche-outer     ``ElCheStrategy(outer_optimizer=OuterNesterov())``: the outer step at every boundary
  elche-async     ``ElCheStrategy(policy="async")``

  Opt-in (``--configs``, ``WINDOW_PROBES``): ``elche-window-N``, the defaults with the window fixed at N
  steps (``anchor = min_anchor = max_anchor = N``), ``elche-sync`` (averaging after every step) and
  ``elche-sync-sqrt2`` (the same with an outer step of sqrt(2), the size of DDP's AdamW step): does a
  shorter window close the char LM's gap to DDP at k = 1?

Evaluation (``benchmarks/tta_copies.py``): a copy of the consensus model at the first point where
the ranks agree on it at or after each multiple of the task's interval of cohort samples (4,000 for
fashion, 6,000 for mlp, 640 blocks for charlm), scored on held-out data after the job (the first
5,000 test images, the same for every copy; 128 held-out blocks of text), so evaluation
costs the training clock only the copy (timed, reported, as is the scoring time). The training
clock is rank 0's wall time from the start of training (set-up, launch and teardown excluded).
*Time to target* and *samples to target* are those of the first copy at the target; every ratio is
paired with the fast device alone of the same repeat and k, and ``k / (k + 1)`` is the ideal (two
devices, the second k times slower, needing the same samples).

Order: repeat by repeat; in each, task by task, k by k, the configurations in an order rotated every
repeat. Results go to ``benchmarks/results/time_to_accuracy.json`` after every task of every repeat
(``"complete": false`` until the end), the plots to ``benchmarks/plots/tta_<task>.png``.

Whole fit (``--parts whole-fit``): one epoch of Fashion-MNIST with the small CNN at k = 3, the fast
device alone against ElChe's configurations, each a fresh ``python`` command as a user runs it
(Lightning's launcher starting rank 1, forked warm from the zygote made as the script imported
lightning_elche; ``elche-cold``: the defaults with ``ELCHE_COLD_START=1``, rank 1 a new interpreter as
before 0.3): the whole fit from the command's start to its exit against the training loop alone, and
the launch and teardown between them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

if __package__ in (None, ""):  # run as `python benchmarks/time_to_accuracy.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import tta_summary
from benchmarks.fashion import choose_data
from benchmarks.harness import conclude, results_path, run_job
from benchmarks.provenance import REPO, Failures, rotated, write_results
from benchmarks.tta_copies import ConsensusAtSamples, SampleCopies, consensus_points
from benchmarks.tta_tasks import TASKS, Task
from lightning_elche import ElCheStrategy, OuterNesterov, Slowdown
from lightning_elche._jobs import QUIET_TRAINER, main_or_worker, write_report
from lightning_elche._jobs import run_job as run_fresh

MODULE = "benchmarks.time_to_accuracy"

# ElChe's configurations: the one place they are written down (flat ElCheStrategy arguments).
ELCHE: dict[str, Callable[[], dict[str, Any]]] = {
    "elche": lambda: {},
    "elche-plain": lambda: {"outer_optimizer": "none"},
    "elche-outer": lambda: {"outer_optimizer": OuterNesterov()},
    "elche-async": lambda: {"policy": "async"},
}
# Not in the default run: do shorter windows close the char LM's gap to DDP at k = 1? (They do not:
# benchmarks/README.md, "Shorter windows on the char LM".)
WINDOW_PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "elche-window-1": lambda: {"anchor": 1, "min_anchor": 1, "max_anchor": 1},
    "elche-window-2": lambda: {"anchor": 2, "min_anchor": 2, "max_anchor": 2},
    "elche-window-5": lambda: {"anchor": 5, "min_anchor": 5, "max_anchor": 5},
    "elche-sync": lambda: {"policy": "sync"},
    # Averaging after every step with an outer step of sqrt(2) (benchmarks/optimizer_averaging.py's
    # sqrt-1): the size of AdamW's step on the two halves' averaged gradient, as DDP takes it.
    "elche-sync-sqrt2": lambda: {"policy": "sync", "outer_optimizer": OuterNesterov(lr=math.sqrt(2), momentum=0.0)},
}
CONFIGS = ("fast-alone", "ddp", "torchft-diloco", *ELCHE)
COLD = "elche-cold"  # the whole fit only: ElChe's defaults with rank 1 a fresh interpreter (ELCHE_COLD_START=1), as before 0.3
WHOLE_FIT_CONFIGS = ("fast-alone", *ELCHE, COLD)
DILOCO = {"sync_every": 16, "outer_lr": 0.7, "outer_momentum": 0.9}  # benchmarks/peers.py's, DiLoCo's paper's outer step
ELCHE_TIMEOUT_S = 120  # a collective that waits longer is a failure, not a slow run

QUICK = {
    "slowdowns": [2.0], "repeats": 1, "whole_fit_repeats": 1, "whole_fit_configs": ["elche"],
    "train_samples": {"fashion": 768, "mlp": 1024, "charlm": 192}, "epochs": {"fashion": 1, "mlp": 2, "charlm": 1},
    "every_samples": {"fashion": 256, "mlp": 512, "charlm": 64}, "target": {"fashion": 0.25, "mlp": 0.25, "charlm": 4.0},
    "test_samples": 512, "whole_fit_samples": 1024, "timeout": 240,
}  # fmt: skip


class TaskModule(pl.LightningModule):
    """A task's network, loss, optimizer and schedule (per DDP-equivalent step) under Lightning."""

    def __init__(self, task: Task, net: torch.nn.Module, train_set: Dataset) -> None:
        super().__init__()
        self.task, self.net, self.train_set = task, net, train_set

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.task.loss(self.net, batch)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = self.task.optimizers(self.net, int(self.trainer.estimated_stepping_batches))
        if schedule is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.task.batch_size, shuffle=True)


def strategy(name: str, elche_settings: dict[str, Any]) -> Any:
    if name == "fast-alone":
        return "auto"
    if name == "ddp":
        return "ddp"
    return ElCheStrategy(timeout=ELCHE_TIMEOUT_S, **elche_settings)


def lightning_worker(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(config["seed"], verbose=False)
    task = TASKS[config["task"]]
    settings = {**ELCHE, **WINDOW_PROBES}.get(config["name"], dict)()  # COLD: the defaults
    copies = SampleCopies(config["every_samples"])
    clock = ConsensusAtSamples(copies, every_rank=settings.get("policy") == "async", gamma=settings.get("gamma", 1.0))
    callbacks: list[pl.Callback] = [clock]
    if config["ranks"] > 1 and config["k"] != 1:
        callbacks.append(Slowdown({1: config["k"]}))
    trainer = pl.Trainer(
        devices=config["ranks"], strategy=strategy(config["name"], settings), max_epochs=config["epochs"], callbacks=callbacks,
        limit_val_batches=0, gradient_clip_val=task.clip, **QUIET_TRAINER,
    )  # fmt: skip
    module = TaskModule(task, task.network(config), task.train_set(config))
    trainer.fit(module)
    rank = trainer.global_rank
    if rank == 0 or clock.every_rank:
        copies.finish(module.net, clock.seconds, clock.cohort_samples, Path(config["snapshots"]) / f"rank{rank}.pt",
                      clock.weight, clock.boundaries_seen)  # fmt: skip
    boundaries = getattr(trainer.strategy, "boundaries", None) or []
    write_report(config["out"], rank, {
        "seconds": clock.seconds, "samples": clock.samples, "cohort_samples": clock.cohort_samples,
        "started_unix": clock.started_unix, "ended_unix": clock.ended_unix, "boundaries": len(boundaries),
        "final_anchor": boundaries[-1].anchor if boundaries else None,
    })  # fmt: skip


def worker(config: dict[str, Any]) -> None:
    if config["name"] == "torchft-diloco":
        from benchmarks.tta_diloco import diloco_worker

        diloco_worker(config)
    else:
        lightning_worker(config)


def job_config(task_name: str, name: str, k: float, seed: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    task = TASKS[task_name]
    return {
        "task": task_name, "name": name, "k": k, "seed": seed, "ranks": 1 if name == "fast-alone" else 2, "data": args.data,
        "train_samples": args.train_samples.get(task_name), "test_samples": args.test_samples,
        "epochs": args.epochs.get(task_name, task.epochs), "every_samples": args.every_samples.get(task_name, task.every_samples),
        "snapshots": folder, "out": str(Path(folder) / "reports"), **DILOCO,
    }  # fmt: skip


def run_configuration(task_name: str, name: str, k: float, seed: int, args: argparse.Namespace, metric: Callable) -> dict[str, Any]:
    """One job, then its copies scored: the curve of (training seconds, cohort samples, metric)."""
    with tempfile.TemporaryDirectory(prefix="elche-tta-") as folder:
        config = job_config(task_name, name, k, seed, args, folder)
        load_before = os.getloadavg()[0]
        if name == "torchft-diloco":
            from benchmarks.tta_diloco import run_diloco

            reports = run_diloco(MODULE, config, args.timeout)
        else:
            reports = run_job(MODULE, worker, config, config["ranks"], args.timeout, warm=args.quick)
        load_after = os.getloadavg()[0]
        saved = [torch.load(path) for path in sorted(Path(folder).glob("rank*.pt"))]
    points = consensus_points([s["points"] for s in saved])
    scoring = time.perf_counter()
    curve = [(round(p["seconds"], 3), p["samples"], metric(p["state"])) for p in points]
    eval_s = time.perf_counter() - scoring
    seconds = max(r["seconds"] for r in reports)
    samples = sum(r["samples"] for r in reports)
    gaps = [b[1] - a[1] for a, b in zip(curve, curve[1:])]
    return {
        "curve": curve, "train_s": seconds, "samples": samples, "samples_per_s": samples / seconds, "final_metric": curve[-1][2],
        "evaluations": len(curve), "largest_gap_samples": max(gaps, default=0), "eval_s": eval_s,
        "copy_s": sum(s["copy_s"] for s in saved), "boundaries": reports[0].get("boundaries"),
        "final_anchor": reports[0].get("final_anchor"), "load_before": load_before, "load_after": load_after,
    }  # fmt: skip


def run_whole_fit(name: str, seed: int, args: argparse.Namespace, metric: Callable) -> dict[str, Any]:
    """One fresh ``python -m`` command, as a user runs it: the whole fit (start to exit) and its phases."""
    with tempfile.TemporaryDirectory(prefix="elche-tta-fit-") as folder:
        config = dict(job_config("fashion", name, args.whole_fit_k, seed, args, folder), epochs=1, train_samples=args.whole_fit_samples,
                      every_samples=10**12)  # the final model only: the fit as a user runs it
        launched = time.time()
        cold = {"ELCHE_COLD_START": "1"} if name == COLD else {}
        reports = run_fresh(MODULE, config, ranks=config["ranks"], timeout=args.timeout, cwd=str(REPO), env=cold)
        ended = time.time()
        final = torch.load(Path(folder) / "rank0.pt")["points"][-1]
    rank0 = reports[0]
    return {
        "whole_fit_s": ended - launched, "training_loop_s": rank0["seconds"], "launch_s": rank0["started_unix"] - launched,
        "teardown_s": ended - rank0["ended_unix"], "samples": sum(r["samples"] for r in reports), "final_metric": metric(final["state"]),
    }  # fmt: skip


def measure(args: argparse.Namespace, failures: Failures, results: Optional[dict[str, Any]] = None,
            earlier: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Every job of every repeat, or (``results``: a stopped run's, ``--resume``; ``earlier``: its
    provenance) those it has not run yet."""
    torch.set_num_threads(1 if args.quick else 2)  # scoring runs between jobs, never during one
    results = dict(results or {"tasks": {}, "whole_fit": None}, complete=False)
    metrics = {name: TASKS[name].scorer(job_config(name, "fast-alone", 1.0, 0, args, "")) for name in args.tasks if args.repeats}
    jobs = len(args.tasks) * len(args.slowdowns) * len(args.configs) * args.repeats + len(args.whole_fit_configs) * args.whole_fit_repeats
    jobs -= already_run(results, args)
    done, began = 0, time.time()

    def progress(label: str, repeat: int, shown: str) -> None:
        nonlocal done
        done += 1
        left = (time.time() - began) / done * (jobs - done)
        print(f"[{done}/{jobs}, {left / 60:.0f} min left] {label} repeat {repeat + 1}: {shown}", flush=True)

    for repeat in range(max(args.repeats, args.whole_fit_repeats)):
        for task_name in args.tasks if repeat < args.repeats else []:
            task = TASKS[task_name]
            entry = results["tasks"].setdefault(task_name, {
                "metric": task.metric, "higher_is_better": task.higher_is_better, "target": args.target.get(task_name, task.target),
                "every_samples": args.every_samples.get(task_name, task.every_samples),
                "epochs": args.epochs.get(task_name, task.epochs), "by_k": {},
            })  # fmt: skip
            for k in args.slowdowns:
                runs = entry["by_k"].setdefault(f"{k:g}", {"runs": {}})["runs"]
                for name in rotated(list(args.configs), repeat):
                    if len(runs.setdefault(name, [])) > repeat:
                        continue  # run before this --resume
                    label = f"{task_name} k={k:g} {name}"
                    run = failures.attempt(label, repeat, lambda: run_configuration(task_name, name, k, repeat, args, metrics[task_name]))
                    runs[name].append(run)
                    progress(label, repeat, "failed" if run is None else
                             f"{run['train_s']:.1f} s, {run['samples_per_s']:.0f} samples/s, final {run['final_metric']:.4g}, "
                             f"{run['evaluations']} evaluations in {run['eval_s']:.1f} s")
            save(args, results, failures, list(earlier))
        if "whole-fit" in args.parts and repeat < args.whole_fit_repeats:
            fits = results["whole_fit"] = results["whole_fit"] or {
                "k": args.whole_fit_k, "samples": args.whole_fit_samples, "runs": {name: [] for name in args.whole_fit_configs}}
            metric = metrics.get("fashion") or TASKS["fashion"].scorer(job_config("fashion", "fast-alone", 1.0, 0, args, ""))
            for name in rotated(list(args.whole_fit_configs), repeat):
                if len(fits["runs"].setdefault(name, [])) > repeat:
                    continue  # run before this --resume
                label = f"whole fit k={args.whole_fit_k:g} {name}"
                run = failures.attempt(label, repeat, lambda: run_whole_fit(name, repeat, args, metric))
                fits["runs"][name].append(run)
                progress(label, repeat, "failed" if run is None else
                         f"whole fit {run['whole_fit_s']:.1f} s, training loop {run['training_loop_s']:.1f} s")
            save(args, results, failures, list(earlier))
    results["complete"] = True
    tta_summary.add_summaries(results)
    return results


def already_run(results: dict[str, Any], args: argparse.Namespace) -> int:
    """How many of this run's jobs a resumed run had run (each job's runs count its repeats, a failed one too)."""
    count = sum(
        min(len(results["tasks"].get(task, {}).get("by_k", {}).get(f"{k:g}", {}).get("runs", {}).get(name, [])), args.repeats)
        for task in args.tasks for k in args.slowdowns for name in args.configs
    )  # fmt: skip
    fits = (results.get("whole_fit") or {}).get("runs", {})
    return count + sum(min(len(fits.get(name, [])), args.whole_fit_repeats) for name in args.whole_fit_configs)


def resumed(args: argparse.Namespace, failures: Failures) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """``--resume``: the stopped run's results and failures from ``--json``, and the provenance of every
    run it continues (the tables' provenance line names them: ``benchmarks/tables.py``)."""
    if not args.resume:
        return None, []
    if not Path(args.json).exists():
        sys.exit(f"--resume: no results to resume at {args.json}; run without --resume first")
    record = json.loads(Path(args.json).read_text())
    failures.records.extend(record["failures"])
    return record["results"], [*record.get("resumed_from", []), record["provenance"]]


def save(args: argparse.Namespace, results: dict[str, Any], failures: Failures, earlier: list[dict[str, Any]]) -> None:
    """The results so far, so that hours of measurement survive a stop (``"complete": false`` until the end)."""
    tta_summary.add_summaries(results)
    write_results(args.json, "time_to_accuracy", args, results, failures, **({"resumed_from": earlier} if earlier else {}))


def tables(record: dict[str, Any]) -> dict[str, str]:
    """Every table of the results (``benchmarks/tables.py`` puts the marked ones into the READMEs)."""
    return tta_summary.tables(record)


def pairs(option: str, values: Optional[list[str]], cast: Callable[[str], Any]) -> dict[str, Any]:
    """``--target charlm=1.8 ...`` -> ``{"charlm": 1.8}``; a bad entry exits naming the option and what it takes."""
    out = {}
    for value in values or []:
        task, sep, number = value.partition("=")
        if not sep or task not in TASKS:
            sys.exit(f"--{option}: expected TASK=VALUE with TASK one of {', '.join(TASKS)}, got {value!r}")
        try:
            out[task] = cast(number)
        except ValueError:
            sys.exit(f"--{option} {value}: {number!r} is not a{'n integer' if cast is int else ' number'}")
    return out


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="k of rank 1")
    parser.add_argument("--configs", nargs="+", choices=(*CONFIGS, *WINDOW_PROBES), default=list(CONFIGS),
                        help=f"default: all but {', '.join(WINDOW_PROBES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", nargs="+", choices=("tasks", "whole-fit"), default=["tasks", "whole-fit"])
    parser.add_argument("--target", nargs="+", metavar="TASK=VALUE", help="targets (default: the task's; lower is better for charlm)")
    parser.add_argument("--epochs", nargs="+", metavar="TASK=N", help="passes over the training data (default: the task's)")
    parser.add_argument("--train-samples", nargs="+", metavar="TASK=N", help="training samples, blocks for charlm (default: all)")
    parser.add_argument("--every-samples", nargs="+", metavar="TASK=N", help="evaluation interval in cohort samples")
    parser.add_argument("--test-samples", type=int, default=5000,
                        help="test images scored, the first N of the 10k (default 5000: scoring is most of the run's time off the clock)")
    parser.add_argument("--data", choices=("fashion", "digits"), default="fashion", help="images of fashion and mlp")
    parser.add_argument("--whole-fit-k", type=float, default=3.0)
    parser.add_argument("--whole-fit-repeats", type=int, default=None, help="default: --repeats")
    parser.add_argument("--whole-fit-configs", nargs="+", choices=WHOLE_FIT_CONFIGS, default=list(WHOLE_FIT_CONFIGS))
    parser.add_argument("--whole-fit-samples", type=int, default=None, help="images of the one-epoch fit (default: all 60k)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung")
    parser.add_argument("--quick", "--smoke", action="store_true", help="every code path once, tiny (about 2 minutes)")
    parser.add_argument("--report", action="store_true", help="no training: tables and plots from --json (and --target)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --json: only the jobs it has not run (same arguments; e.g. more --repeats)")
    parser.add_argument("--plots", type=Path, default=REPO / "benchmarks" / "plots", help="where the plots go")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/time_to_accuracy.json")
    args = parser.parse_args(argv)
    for key, cast in (("target", float), ("epochs", int), ("train_samples", int), ("every_samples", int)):
        setattr(args, key, pairs(key.replace("_", "-"), getattr(args, key), cast))
    if args.quick and not args.report:
        for key, value in QUICK.items():
            setattr(args, key, {**value, **getattr(args, key)} if isinstance(value, dict) else value)
    if args.whole_fit_repeats is None or "whole-fit" not in args.parts:
        args.whole_fit_repeats = args.repeats if "whole-fit" in args.parts else 0
    if "tasks" not in args.parts:
        args.repeats = 0
    args.data = choose_data(args.data)
    args.smoke = args.quick and not args.report  # harness.results_path: a quick run's results go to the temporary folder
    args.json = results_path("time_to_accuracy", args)
    return args


def main() -> None:
    args = parse()
    if args.report:
        tta_summary.report(args.json, args.target, args.plots)
        return
    failures = Failures()
    earlier_results, earlier = resumed(args, failures)
    results = measure(args, failures, earlier_results, earlier)
    tta_summary.plot_all(results, args.plots if not args.quick else Path(args.json).parent / "tta_plots")
    conclude("time_to_accuracy", args, results, failures, tables, **({"resumed_from": earlier} if earlier else {}))


if __name__ == "__main__":
    main_or_worker(main, worker)
