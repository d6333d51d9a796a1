"""Elastic fits SIGKILLed at random instants (issue 34): does every fit finish, train every sample
once and end with identical survivors, wherever the kills land?

    python -m benchmarks.fault_sweep                     # 25 fits x 8 kills, more fits until 200 kills; 3 ranks
    python -m benchmarks.fault_sweep --fits 5 --kills 4  # a shorter sweep
    python -m benchmarks.fault_sweep --smoke --json /tmp/fault_sweep.json   # 1 fit x 2 kills, 3 ranks (the suite)

Each fit is ``benchmarks/elastic_goodput.py``'s elastic job: ``python -m lightning_elche.launch --nproc 3
--replace --spares 1``, scikit-learn's digits, an MLP, a 40 ms sleep per step for an accelerator's
compute, each member writing the ledger of the windows it trained and of the boundaries that averaged
them. The driver first runs the fit once without a kill to learn its span, from its first rank's start
to its end (or takes ``--span``, as the smoke run does). Every fit of the sweep then SIGKILLs ``--kills``
processes at instants drawn uniformly over that span from its own first rank's start (seeded per fit),
each time one picked at random among the fit's processes alive then: members, spares waiting for a
place, joiners on their way in. The last member alive is never picked: a fit needs one to carry its
state (with none left, it ends with the error of its members, as docs/elastic.md says).

Where a kill landed is read from its victim's own files at the instant:

- ``starting``: a member that has not trained a batch yet (its interpreter, imports, set-up, the first
  rendezvous, a replacement's admission);
- ``waiting spare``: a spare that has not trained yet (waiting for a place, or being admitted to one);
- ``in a boundary``: a member between the window note it writes as a boundary starts and the note
  after the boundary averaged (inside the control and parameter reduces, a membership change);
- ``training``: a member between boundaries.

Must hold for every fit: the launch exits 0 (the fit finished), every sample of every epoch is in
exactly one averaged window (``elastic_goodput.verify_ledger``), and the members that finished the
fit hold identical parameters. A fit where one does not is recorded as failed (the sweep goes on, and
exits 1). The targeted instants (inside a boundary's all-reduce, between the control and parameter
reduces, while a checkpoint is written...) are tests: ``tests/test_elastic.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as `python benchmarks/fault_sweep.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.elastic_goodput import SCRIPT as JOB
from benchmarks.elastic_goodput import verify_ledger
from benchmarks.harness import BenchmarkFailed, cell, conclude, results_path, run_in_session
from benchmarks.provenance import REPO, Failures, spread
from lightning_elche.lightning.warm_start import process_alive

INSTANTS = ("starting", "waiting spare", "in a boundary", "training")
SAMPLES = 1437  # the job's epoch: scikit-learn's digits, their training split (benchmarks/fashion.py)
SMOKE = {"fits": 1, "kills": 2, "min_kills": 0, "epochs": 6, "span": 12.0, "timeout": 300.0}  # no fit without a kill: a given span


def job_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"way": "elastic", "data": "digits", "ranks": args.ranks, "samples": SAMPLES, "epochs": args.epochs,
            "batch_size": 32, "accelerator_ms": 40.0, "checkpoint_every": 0, "elche_timeout": args.elche_timeout}  # fmt: skip


def launch_command(args: argparse.Namespace, folder: Path, kills: int) -> list[str]:
    return [sys.executable, "-m", "lightning_elche.launch", "--nproc", str(args.ranks), "--exit-grace", "20",
            "--replace", "--max-replacements", str(max(kills, 1)), "--spares", "1",
            str(JOB), "--worker", str(folder), json.dumps(job_config(args))]  # fmt: skip


def environment() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def instant_of(folder: Path, name: str, ranks: int) -> str:
    """Where process ``name`` (``m<member>``) is, from its own files (see the module's docstring)."""
    if not (folder / f"first_batch_{name}.json").exists():
        return "waiting spare" if int(name[1:]) >= ranks else "starting"
    ledger = folder / f"ledger_{name}.jsonl"
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    last = json.loads(lines[-1]) if lines and lines[-1].endswith("}") else {}
    return "in a boundary" if "window" in last else "training"


class Killer:
    """SIGKILLs a random live process of the fit at each of ``times`` (seconds after its first rank started)."""

    def __init__(self, folder: Path, times: list[float], rng: random.Random, ranks: int) -> None:
        self.folder, self.due, self.rng, self.ranks = folder, list(times), rng, ranks
        self.killed: list[dict[str, Any]] = []

    def __call__(self) -> None:
        started = first_start(self.folder)
        if not self.due or started is None or time.time() - started < self.due[0]:
            return
        self.due.pop(0)
        victims = self._victims()
        if not victims:
            return  # the last member is all that is alive: this kill is not made
        name, pid = self.rng.choice(victims)
        instant = instant_of(self.folder, name, self.ranks)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed.append({"victim": name, "after_s": round(time.time() - started, 2), "instant": instant})

    def _victims(self) -> list[tuple[str, int]]:
        dead = {k["victim"] for k in self.killed}
        alive = []
        for path in self.folder.glob("pid_m*.json"):
            name = path.name[len("pid_") : -len(".json")]
            pid = _read(path)["pid"]
            if name not in dead and not (self.folder / f"final_{name}.json").exists() and process_alive(pid):
                alive.append((name, pid))
        members = [n for n, _ in alive if int(n[1:]) < self.ranks or (self.folder / f"first_batch_{n}.json").exists()]
        keep = set(members) if len(members) <= 1 else set()
        return sorted((n, p) for n, p in alive if n not in keep)


def first_start(folder: Path) -> Optional[float]:
    """When the fit's first rank started (its pid file, written before its imports)."""
    times = [_read(path)["t"] for path in folder.glob("pid_m*.json")]
    return min(times) if times else None


def run_fit(args: argparse.Namespace, seed: int, span_s: float, kills: int) -> dict[str, Any]:
    """One fit with ``kills`` kills at instants uniform over ``span_s``; its folder is removed after a success."""
    folder = Path(tempfile.mkdtemp(prefix=f"elche-fault-sweep-{seed}-"))
    rng = random.Random(seed)
    killer = Killer(folder, sorted(rng.uniform(0, span_s) for _ in range(kills)), rng, args.ranks)
    what = lambda: f"fit {seed} after kills {killer.killed}"  # noqa: E731
    wall = run_in_session(launch_command(args, folder, kills), folder / "launch.log", environment(), args.timeout, killer, what)
    started = first_start(folder)
    assert started is not None
    span = max(_read(folder / f"final_{name}.json")["t"] for name in _finished(folder)) - started
    coverage = verify_ledger(folder, SAMPLES, args.epochs)
    digests = {name: _read(folder / f"final_{name}.json")["digest"] for name in _finished(folder)}
    if not coverage["exact"]:
        raise BenchmarkFailed(f"{what()}: coverage is not exact: {coverage}; files in {folder}")
    if len(set(digests.values())) != 1:
        raise BenchmarkFailed(f"{what()}: the members that finished differ: {digests}; files in {folder}")
    shutil.rmtree(folder)
    return {"seed": seed, "wall_s": wall, "span_s": span, "kills": killer.killed, "finished": sorted(digests)}


def _finished(folder: Path) -> list[str]:
    return [p.name[len("final_") : -len(".json")] for p in folder.glob("final_m*.json")]


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, Any]:
    started = time.time()
    clean, span = None, args.span
    if span is None:
        clean = failures.attempt("no kill", 0, lambda: run_fit(args, seed=0, span_s=0.0, kills=0))
        if clean is None:
            return {"clean": None, "fits": [], "sweep_s": time.time() - started}
        span = clean["span_s"]
        print(f"the fit without a kill: {span:.1f} s from its first rank's start to its end ({clean['wall_s']:.1f} s "
              "launch to exit); kills land uniformly over that span", flush=True)
    fits: list[dict[str, Any]] = []
    fit = 0
    while fit < args.fits or (sum(len(done["kills"]) for done in fits) < args.min_kills and fit < 2 * args.fits):
        done = failures.attempt("sweep", fit, lambda: run_fit(args, seed=args.seed + fit, span_s=span, kills=args.kills))
        if done is not None:
            fits.append(done)
            print(f"fit {fit}: finished in {done['wall_s']:.0f} s after {len(done['kills'])} kills "
                  f"({', '.join(k['instant'] for k in done['kills'])})", flush=True)  # fmt: skip
        fit += 1
    return {"clean": clean, "fits": fits, "sweep_s": time.time() - started}


def summarize(results: dict[str, Any], args: argparse.Namespace, failed: int) -> dict[str, Any]:
    fits = results["fits"]
    landed = Counter(k["instant"] for fit in fits for k in fit["kills"])
    return {
        "fits": len(fits) + failed, "fits_finished": len(fits), "fits_failed": failed,
        "kills": sum(landed.values()), "kills_by_instant": {instant: landed.get(instant, 0) for instant in INSTANTS},
        "fit_wall_s": spread([fit["wall_s"] for fit in fits]) if fits else None,
        "clean_wall_s": results["clean"]["wall_s"] if results["clean"] else None, "sweep_s": results["sweep_s"],
    }  # fmt: skip


def tables(record: dict[str, Any]) -> dict[str, str]:
    summary = record["results"]["summary"]
    lines = ["| where the kill landed | kills |", "|---|---|"]
    lines += [f"| {instant} | {count} |" for instant, count in summary["kills_by_instant"].items()]
    lines.append(f"| **all** | **{summary['kills']}** |")
    clean = summary["clean_wall_s"]
    fits = [
        "| fits | finished, exact coverage, identical survivors | failed | a fit, launch to exit (s) "
        "| without a kill (s) | the sweep (s) |",
        "|---|---|---|---|---|---|",
        f"| {summary['fits']} | {summary['fits_finished']} | {summary['fits_failed']} | {cell(summary['fit_wall_s'], '.0f')} "
        f"| {'' if clean is None else format(clean, '.0f')} | {summary['sweep_s']:.0f} |",
    ]
    return {"kills": "\n".join(lines) + "\n", "fits": "\n".join(fits) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="one fit, two kills: does the sweep run?")
    parser.add_argument("--fits", type=int, default=25)
    parser.add_argument("--kills", type=int, default=8, help="kills per fit")
    parser.add_argument("--min-kills", type=int, default=200,
                        help="more fits (up to twice --fits) until this many kills were made: a kill falls through "
                             "where its instant finds only the last member alive")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=40, help="epochs of the 1,437 digits per fit")
    parser.add_argument("--span", type=float, default=None,
                        help="seconds from the first rank's start over which kills are drawn (default: a fit without a kill's)")
    parser.add_argument("--seed", type=int, default=1, help="the first fit's seed (its kill instants and victims)")
    parser.add_argument("--elche-timeout", type=float, default=30, help="ElCheStrategy(timeout=...)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one fit may take before it is ended as hung")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/fault_sweep.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (a kill must leave a member), got {args.ranks}")
    args.json = results_path("fault_sweep", args)
    failures = Failures()
    results = measure(args, failures)
    results["summary"] = summarize(results, args, len(failures.records))
    conclude("fault_sweep", args, results, failures, tables)


if __name__ == "__main__":
    main()
