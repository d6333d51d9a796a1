"""Dynamic dispatch at 64-1024 ranks, in the cohort simulator: throughput and the store's load.

    python -m benchmarks.dispatch_sim        # about a minute
    python -m benchmarks.dispatch_sim --smoke --json /tmp/dispatch_sim.json   # 16 ranks, a short run

Speeds spread 4x geometrically, a lognormal noise of sigma 0.3 on every window, a 50 ms boundary;
steps of 100 ms (a large model) and 10 ms (a small one). Planned and dynamic dispatch side by
side, with the store at its defaults (0.2 ms round trip, 20 us of server time per operation) and a
slow one (1 ms, 100 us). Prints the fraction of the ideal (the sum of solo rates), ElChe over the
DDP estimate, the largest share of a rank's training time spent claiming, and the store's
utilisation; writes ``benchmarks/results/dispatch_sim.json``. The simulator is seeded: a run prints
the same figures every time, so there are no repeats and no spread. A case that fails is recorded
as failed (JSON and table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as `python benchmarks/dispatch_sim.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import conclude, results_path
from benchmarks.provenance import Failures
from lightning_elche.sim.claims import claim_costs
from lightning_elche.sim.simulator import simulate_cohort, spread_speeds

STORES = {"default store": (0.2, 20.0), "slow store": (1.0, 100.0)}
SMOKE = {"ranks": [16], "seconds": 30.0}


def case(ranks: int, step_ms: float, dispatch: str, claim_ms: float, store_op_us: float, seconds: float) -> dict[str, Any]:
    """One simulated run; ``seconds`` of simulated time with 100 ms steps, a fifth of it with shorter ones."""
    speeds = spread_speeds(ranks, 4.0)
    result = simulate_cohort(
        speeds, step_ms=step_ms, noise=0.3, boundary_ms=50.0, seconds=seconds if step_ms >= 100 else seconds / 5,
        dispatch=dispatch, claim_ms=claim_ms, store_op_us=store_op_us,
    )  # fmt: skip
    row = {"fraction_of_ideal": result.fraction_of_ideal, "speedup_vs_ddp": result.speedup_vs_ddp}
    if dispatch == "dynamic":
        ms = [step_ms / s for s in speeds]
        load = claim_costs(ms, result.final_anchor * max(ms), claim_ms, store_op_us / 1000.0)
        row.update(claim_fraction_max=max(result.claim_fraction, default=0.0), store_utilisation=load.utilisation)
    return row


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, dict[str, Optional[dict[str, Any]]]]:
    cases: dict[str, dict[str, Optional[dict[str, Any]]]] = {}
    for ranks in args.ranks:
        for step_ms in (100.0, 10.0):
            where = f"{ranks}/{step_ms:g}ms"
            planned = failures.attempt(f"{where}/planned", 0, lambda: case(ranks, step_ms, "planned", 0.0, 0.0, args.seconds))
            for store, (claim_ms, store_op_us) in STORES.items():
                dynamic = failures.attempt(
                    f"{where}/{store}", 0, lambda: case(ranks, step_ms, "dynamic", claim_ms, store_op_us, args.seconds)
                )
                cases[f"{where}/{store}"] = {"planned": planned, "dynamic": dynamic}
                print(f"{where}/{store}: {'failed' if dynamic is None else 'done'}", flush=True)
    return cases


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``scale``: one row per ranks x step x store."""
    lines = [
        "| ranks | step | store | planned / ideal | dynamic / ideal | dynamic vs DDP | claiming (max rank) | store load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in record["results"]["cases"].items():
        ranks, step, store = name.split("/")
        planned, dynamic = runs["planned"], runs["dynamic"]
        shown = "failed" if planned is None else f"{planned['fraction_of_ideal']:.2f}"
        if dynamic is None:
            lines.append(f"| {ranks} | {step[:-2]} ms | {store} | {shown} | failed | | | |")
            continue
        lines.append(
            f"| {ranks} | {step[:-2]} ms | {store} | {shown} | {dynamic['fraction_of_ideal']:.2f} | {dynamic['speedup_vs_ddp']:.2f}x "
            f"| {dynamic['claim_fraction_max']:.1%} | {dynamic['store_utilisation']:.2f} |"
        )
    return {"scale": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=300.0, help="simulated seconds with 100 ms steps (10 ms steps: a fifth)")
    parser.add_argument("--smoke", action="store_true", help="16 ranks, 30 simulated seconds: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/dispatch_sim.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("dispatch_sim", args)
    failures = Failures()
    cases = measure(args, failures)
    conclude("dispatch_sim", args, {"cases": cases}, failures, tables,
             spread="none: the simulator is seeded, every run prints the same figures")


if __name__ == "__main__":
    main()
