"""ElChe against what a user would pick instead, side by side on uneven ranks: throughput and time
to accuracy, per slowdown k, from one command.

    python -m benchmarks.peers                  # k = 1, 2, 4; 3 repeats; 35 min to 2 hours here, with the machine's speed
    python -m benchmarks.peers --smoke          # every configuration once on a few hundred digits
    python -m benchmarks.peers --quick          # k = 4, one repeat, five configurations, beside the kept figures (~5 min)
    python -m benchmarks.peers --slowdown-model arithmetic --slowdowns 4 --repeats 2 \\
        --configs ddp torchft-localsgd elche-cadence --json benchmarks/results/peers_arithmetic.json

Every configuration trains the same small CNN (``benchmarks/fashion.py``) on the same Fashion-MNIST
epoch (all ranks together see each of the 60k images once), batch 64 per rank, Adam 1e-3, two rank
processes on this machine's two cores (gloo, one thread each), rank 1 made k times slower:

  fast-alone        one process at full speed on the whole epoch: the fastest device used alone
  ddp               Lightning ``strategy="ddp"``: a gradient all-reduce every step
  post-local-sgd    Lightning's post-local SGD (``benchmarks/peers_lightning.py``): local steps and
                    a parameter average every ``--sync-every`` steps
  torchft-localsgd  torchft 0.2.0 ``LocalSGD``, a plain PyTorch loop as torchft is used
  torchft-diloco    torchft 0.2.0 ``DiLoCo`` (outer Nesterov SGD, lr 0.7, momentum 0.9)
  hivemind          Hivemind 1.1.12 ``hivemind.Optimizer`` with local updates, averaging every
                    2 x 64 x ``--sync-every`` samples of the swarm; the peers draw batches from one
                    shared queue, so the faster one trains more (``benchmarks/peers_hivemind.py``)
  elche-cadence     ``ElCheStrategy()``: the default
  elche-async       ``ElCheStrategy(policy="async")``
  elche-outer       ``ElCheStrategy(outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9))``: DiLoCo's
                    outer step on ElChe's speed-aware windows
The fixed-period peers average every ``--sync-every`` (16) steps, near the windows ElChe's
controller settles on here; they give each rank an equal share, as they are built to.

How a rank is slowed: ``--slowdown-model sleep`` (default) sleeps ``(k - 1)`` times the training
thread's CPU time of each step (``lightning_elche.Slowdown`` and, in the plain loops, its
``StepStretcher``): computation is k times slower, communication and waiting are not, for every
configuration alike. ``arithmetic`` has the slow rank really compute k forward and backward passes
per step instead, a second, independent model of a slower device (it also takes a core).

Reference rates, measured in the same repeat: *ideal* is the sum of each rank's rate training alone
(both solo processes at the same time, so the two-processes-on-two-cores contention is in it);
*synchronous bound* is world size x the slowest rank's solo rate, the most that any method that
waits for every rank every step (or every period, with equal shares) can reach.

Rules: configurations of a repeat run back to back in an order rotated every repeat, every ratio is
paired (both sides from the same repeat), medians with min-max over repeats, training clock only
(set-up excluded; no validation loop). Rank 0 copies the model wherever the ranks agree on it; the
copies are scored on the 10k test images between jobs. A configuration that fails is recorded as
failed and shown so; the script then exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks import peers_lightning
from benchmarks.fashion import choose_data, load_data, score, subset
from benchmarks.harness import both_at_once, cell, conclude, results_path
from benchmarks.provenance import RESULTS, Failures, rotated, spread

CONFIGS = ("fast-alone", "ddp", "post-local-sgd", "torchft-localsgd", "torchft-diloco", "hivemind", "elche-cadence", "elche-async",
           "elche-outer")
LABELS = {
    "fast-alone": "fast rank alone", "ddp": "Lightning DDP", "post-local-sgd": "Lightning post-local SGD",
    "torchft-localsgd": "torchft LocalSGD", "torchft-diloco": "torchft DiLoCo", "hivemind": "Hivemind Optimizer",
    "elche-cadence": "**ElChe cadence**",
    "elche-async": "ElChe async", "elche-outer": "ElChe + outer Nesterov",
}
# A check that the figures still hold after a change, in minutes: k = 4 (the headline), one repeat, ElChe's default
# and outer step beside DDP, the fastest fixed-period peer and the fast rank alone; compared with the kept figures.
QUICK_CONFIGS = ["fast-alone", "ddp", "torchft-diloco", "elche-cadence", "elche-outer"]
QUICK = {"slowdowns": [4.0], "repeats": 1, "configs": QUICK_CONFIGS}
KEPT = RESULTS / "peers.json"
SMOKE = {"data": "digits", "train_samples": 1200, "solo_samples": 256, "test_samples": None, "slowdowns": [2.0], "repeats": 1,
         "target": 0.5, "budget_s": 1.0, "eval_every_s": 0.2, "sync_every": 4, "timeout": 180}


def runner(name: str) -> Callable[[dict[str, Any], float], list[dict[str, Any]]]:
    """The function that runs a configuration as its own job, imported when first needed."""
    if name.startswith("torchft-"):
        from benchmarks import peers_torchft

        return peers_torchft.run
    if name == "hivemind":
        from benchmarks import peers_hivemind

        return peers_hivemind.run
    return peers_lightning.run


def job_config(name: str, k: float, seed: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    alone = name == "fast-alone"
    return {
        "name": name, "algorithm": name.removeprefix("torchft-"), "ranks": 1 if alone else 2,
        "factors": {} if alone else {"1": k}, "slowdown_model": args.slowdown_model, "data": args.data,
        "train_samples": args.train_samples, "epochs": 1, "seed": seed, "batch_size": 64, "lr": 1e-3,
        "sync_every": args.sync_every, "outer_lr": 0.7, "outer_momentum": 0.9, "eval_every_s": args.eval_every_s,
        "budget_s": args.budget_s, "snapshots": str(Path(folder) / "snapshots.pt"), "out": str(Path(folder) / "reports"),
        "warm": args.smoke,  # a smoke run's Lightning jobs fork from this process: no timings are judged there
    }


def run_configuration(name: str, k: float, seed: int, args: argparse.Namespace, test: Any) -> dict[str, Any]:
    """One job: its cohort rate and how its model copies score."""
    with tempfile.TemporaryDirectory(prefix="elche-peers-") as folder:
        config = job_config(name, k, seed, args, folder)
        reports = runner(name)(config, args.timeout)
        points = torch.load(config["snapshots"])
    result = score(points, test, args.target, args.budget_s)
    samples = sum(r["samples"] for r in reports)
    seconds = max(r["seconds"] for r in reports)
    boundary_ms = reports[0].get("boundary_ms") or []
    return {
        **result, "samples_per_s": samples / seconds, "train_s": seconds, "samples": samples,
        "boundary_ms": statistics.median(boundary_ms) if boundary_ms else None, "final_counts": reports[0].get("final_counts"),
    }


def solo_rates(k: float, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """Each rank's rate training alone, both processes at the same time (each on its own core)."""

    def rate(rank: int) -> float:
        with tempfile.TemporaryDirectory(prefix="elche-solo-") as folder:
            config = dict(job_config("fast-alone", k, seed, args, folder), factors={"0": [1.0, k][rank]},
                          train_samples=args.solo_samples, snapshots=None)
            report = peers_lightning.run(config, args.timeout)[0]
            return report["samples"] / report["seconds"]

    fast, slow = both_at_once(rate)
    return {"fast": fast, "slow": slow, "ideal": fast + slow, "sync_bound": 2 * min(fast, slow)}


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, Any]:
    _, test = load_data(args.data)
    test = subset(test, args.test_samples)
    torch.set_num_threads(2)  # scoring runs between jobs, never during one
    results: dict[str, Any] = {}
    for k in args.slowdowns:
        runs: dict[str, list[Optional[dict[str, Any]]]] = {name: [] for name in ["solo", *args.configs]}
        for repeat in range(args.repeats):
            seed = repeat
            for name in rotated(["solo", *args.configs], repeat):
                label = f"{name} k={k:g}"
                if name == "solo":
                    run = failures.attempt(label, repeat, lambda: solo_rates(k, seed, args))
                else:
                    run = failures.attempt(label, repeat, lambda: run_configuration(name, k, seed, args, test))
                runs[name].append(run)
                if run is not None:
                    shown = (f"ideal {run['ideal']:.0f}, sync bound {run['sync_bound']:.0f}" if name == "solo" else
                             f"{run['samples_per_s']:.0f} samples/s, to {args.target:.0%} {run['to_target_s'] or '-'} s, "
                             f"final {run['final_acc']:.2%}")
                    print(f"k={k:g} repeat {repeat + 1} {name:<17} {shown}", flush=True)
        results[f"{k:g}"] = {"runs": runs, "summary": summarize(runs)}
    return results


def summarize(runs: dict[str, list[Optional[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians and spreads per configuration, and ratios paired within each repeat."""
    solo = runs["solo"]

    def paired(name: str, reference: Callable[[int], Optional[float]], key: str = "samples_per_s") -> Optional[dict[str, float]]:
        values = [run[key] / reference(i) for i, run in enumerate(runs[name]) if run and run[key] and reference(i)]
        return spread(values) if values else None

    def solo_of(key: str) -> Callable[[int], Optional[float]]:
        return lambda i: solo[i][key] if solo[i] else None

    def ddp(key: str) -> Callable[[int], Optional[float]]:
        return lambda i: runs["ddp"][i][key] if "ddp" in runs and runs["ddp"][i] else None

    summary: dict[str, Any] = {}
    for key in ("ideal", "sync_bound", "fast", "slow"):
        values = [run[key] for run in solo if run]
        summary[key] = spread(values) if values else None
    for name, results in runs.items():
        if name == "solo":
            continue
        done = [run for run in results if run]
        if not done:
            summary[name] = {"failed": len(results)}
            continue

        def of(key: str) -> Optional[dict[str, float]]:
            values = [run[key] for run in done if run[key] is not None]
            return spread(values) if values else None

        summary[name] = {
            "failed": len(results) - len(done), "reached": sum(run["to_target_s"] is not None for run in done), "runs": len(done),
            "samples_per_s": of("samples_per_s"), "over_ideal": paired(name, solo_of("ideal")),
            "over_sync_bound": paired(name, solo_of("sync_bound")), "over_ddp": paired(name, ddp("samples_per_s")),
            "to_target_s": of("to_target_s"), "to_target_over_ddp": paired(name, ddp("to_target_s"), "to_target_s"),
            "to_target_samples": of("to_target_samples"), "acc_at_budget": of("acc_at_budget"), "final_acc": of("final_acc"),
            "boundary_ms": of("boundary_ms"),
        }
    return summary


def table(summary: dict[str, Any], target: float, budget_s: float) -> str:
    lines = [
        f"| configuration | samples/s | of ideal | of synchronous bound | vs DDP | reached {target:.0%} | time to {target:.0%} (s) "
        f"| vs DDP | samples to {target:.0%} (k) | accuracy at {budget_s:g} s | accuracy after the epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| ideal (solo rates summed) | {cell(summary['ideal'], '.0f')} | 1 | | | | | | | | |",
        f"| synchronous bound (2 x slowest solo) | {cell(summary['sync_bound'], '.0f')} | | 1 | | | | | | | |",
    ]
    for name, row in summary.items():
        if name in ("ideal", "sync_bound", "fast", "slow"):
            continue
        label = LABELS.get(name, name)
        if row.get("runs") is None:
            lines.append(f"| {label} | failed ({row['failed']} of {row['failed']} runs) | | | | | | | | | |")
            continue
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        lines.append(
            f"| {label}{failed} | {cell(row['samples_per_s'], '.0f')} | {cell(row['over_ideal'])} | {cell(row['over_sync_bound'])} "
            f"| {cell(row['over_ddp'])} | {row['reached']}/{row['runs']} | {cell(row['to_target_s'], '.1f')} "
            f"| {cell(row['to_target_over_ddp'])} | {cell(row['to_target_samples'], '.1f', 1e-3)} "
            f"| {cell(row['acc_at_budget'], '.1%')} | {cell(row['final_acc'], '.1%')} |"
        )
    return "\n".join(lines) + "\n"


PEERS = ("ddp", "post-local-sgd", "torchft-localsgd", "torchft-diloco", "hivemind")


def headline(results: dict[str, Any], target: float) -> str:
    """ElChe's default against DDP and against the best peer at each k, for the README."""
    lines = [f"| rank 1 slowed | ElChe cadence, samples/s | of ideal | vs DDP | vs the fastest peer | time to {target:.0%} vs DDP |",
             "|---|---|---|---|---|---|"]
    for k, result in results.items():
        summary = result["summary"]
        elche = summary.get("elche-cadence") or {}
        if not elche.get("samples_per_s"):
            lines.append(f"| {k}x | failed | | | | |")
            continue
        measured = [name for name in PEERS if (summary.get(name) or {}).get("samples_per_s")]
        best = max(measured, key=lambda name: summary[name]["samples_per_s"]["median"], default=None)
        versus = "-" if best is None else (
            f"{elche['samples_per_s']['median'] / summary[best]['samples_per_s']['median']:.2f}x ({LABELS[best]})"
        )
        lines.append(f"| {k}x | {cell(elche['samples_per_s'], '.0f')} | {cell(elche['over_ideal'])} | {cell(elche['over_ddp'], unit='x')} "
                     f"| {versus} | {cell(elche['to_target_over_ddp'], unit='x')} |")
    return "\n".join(lines) + "\n"


def tables(record: dict[str, Any]) -> dict[str, str]:
    """One table per slowdown k and the README's headline (benchmarks/tables.py puts them into the READMEs)."""
    args, results = record["args"], record["results"]
    target = float(args["target"])
    out = {f"k={k}": table(result["summary"], target, float(args["budget_s"])) for k, result in results.items()}
    out["headline"] = headline(results, target)
    return out


def against_kept(record: dict[str, Any], kept: dict[str, Any]) -> str:
    """Each configuration's rate over the ideal and over DDP now, beside the kept figures' median and range
    at the same k (another machine's kept figures differ in rate, less in these ratios)."""
    lines = ["| k, configuration | of ideal: now, kept | vs DDP: now, kept |", "|---|---|---|"]
    for k, result in record["results"].items():
        before = kept["results"].get(k, {}).get("summary", {})
        for name, row in result["summary"].items():
            if name in ("ideal", "sync_bound", "fast", "slow") or not row.get("samples_per_s"):
                continue
            old = before.get(name) or {}
            lines.append(f"| {k}x {LABELS.get(name, name)} | {cell(row['over_ideal'])}, {cell(old.get('over_ideal'))} "
                         f"| {cell(row['over_ddp'])}, {cell(old.get('over_ddp'))} |")
    return "\n".join(lines) + "\n"


def settle(args: argparse.Namespace) -> None:
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.data = choose_data(args.data)
    if args.slowdown_model == "arithmetic" and any(k != int(k) for k in args.slowdowns):
        sys.exit("--slowdown-model arithmetic repeats the computation k times: every --slowdowns value must be a whole number")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="k of rank 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--slowdown-model", choices=("sleep", "arithmetic"), default="sleep")
    parser.add_argument("--data", choices=("fashion", "digits"), default="fashion")
    parser.add_argument("--train-samples", type=int, default=None, help="train on the first N images only (default: all 60k)")
    parser.add_argument("--solo-samples", type=int, default=12288, help="samples of each solo-rate run")
    parser.add_argument("--test-samples", type=int, default=None)
    parser.add_argument("--target", type=float, default=0.84, help="target test accuracy")
    parser.add_argument("--budget-s", type=float, default=8.0, help="training-clock seconds of 'accuracy at'")
    parser.add_argument("--eval-every-s", type=float, default=1.0, help="copy interval, training clock")
    parser.add_argument("--sync-every", type=int, default=16, help="steps between the fixed-period peers' averages")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a job counts as hung")
    parser.add_argument("--smoke", action="store_true", help="every configuration once, tiny: does everything run?")
    parser.add_argument("--quick", action="store_true",
                        help=f"k = 4, one repeat, {', '.join(QUICK_CONFIGS)}: do the kept figures still hold? (peers_quick.json)")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/peers.json (a smoke run's: a temporary file)")
    args = parser.parse_args()
    settle(args)
    args.json = results_path("peers", args)
    failures = Failures()
    render = tables
    if args.quick and KEPT.exists():
        kept = json.loads(KEPT.read_text())
        heading = f"against the kept figures ({kept['provenance']['commit'][:7]}, {kept['provenance']['machine']})"

        def render(record: dict[str, Any]) -> dict[str, str]:
            return {**tables(record), heading: against_kept(record, kept)}
    conclude("peers", args, measure(args, failures), failures, render)


if __name__ == "__main__":
    main()
