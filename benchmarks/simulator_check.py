"""Does the cohort simulator predict what the peers benchmark measured? Better than a trivial guess?
And how fast is it at scale?

    python -m benchmarks.simulator_check       # after python -m benchmarks.peers; seconds

Part 1 replays every repeat of ``benchmarks/results/peers.json`` (2 ranks, rank 1 k times slower,
one epoch, batch 64 per rank) in :func:`lightning_elche.sim.simulator.simulate_cohort`
and compares the predicted ElChe cadence throughput with the one measured in that repeat. Its inputs
are measured in the same repeat and are not the figure it is checked against:

- each rank's step time, from the two solo rates (both solo processes running at the same time);
- the boundary cost: the median over the ElChe run's boundaries of the smallest rank's boundary time
  (the last rank to arrive waits for nobody, so its time is the averaging itself);
- for the DDP estimate, DDP's per-step all-reduce, from the same repeat's k = 1 DDP run (its step
  minus the fast solo step), so DDP is predicted only when k = 1 was measured;
- per-step noise ``NOISE``, an assumption (it barely moves windows of 10+ steps).

The errors are set beside two trivial predictors that need no simulator: ElChe at the ideal (the
solo rates summed) and at ``TRIVIAL_SHARE`` of it, and DDP at the synchronous bound (twice the slow
solo rate). A simulator that does not beat them says nothing the ideal does not.

Part 2 runs spread-speed cohorts of 2 to 1024 simulated ranks: the controller's cost per boundary
and the wall time of each simulation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.provenance import RESULTS, write_results
from lightning_elche.sim.simulator import simulate_cohort, spread_speeds

BATCH = 64
SEEDS = range(5)  # predictions are medians over these noise seeds
NOISE = 0.05
TRIVIAL_SHARE = 0.96


def predict(solo: dict[str, float], boundary_ms: float, allreduce_ms: Optional[float], samples: int) -> tuple[float, Optional[float]]:
    """(ElChe, DDP) samples/s predicted from one repeat's measured inputs, medians over noise seeds."""
    fast_ms, slow_ms = 1000.0 * BATCH / solo["fast"], 1000.0 * BATCH / solo["slow"]
    runs = [
        simulate_cohort([1.0, fast_ms / slow_ms], step_ms=fast_ms, noise=NOISE, boundary_ms=boundary_ms, allreduce_ms=allreduce_ms,
                        batch_size=BATCH, epochs=1, epoch_samples=samples, seed=seed)
        for seed in SEEDS
    ]
    ddp = statistics.median(r.ddp.samples_per_s for r in runs) if allreduce_ms is not None else None
    return statistics.median(r.samples_per_s for r in runs), ddp


def allreduce_ms(peers: dict[str, Any], repeat: int) -> Optional[float]:
    """DDP's per-step communication at k = 1 in this repeat: its step minus the fast solo step."""
    runs = peers.get("1", {}).get("runs", {})
    solo, ddp = (runs.get(name, [None] * (repeat + 1))[repeat] for name in ("solo", "ddp"))
    if not solo or not ddp:
        return None
    return max(1000.0 * 2 * BATCH / ddp["samples_per_s"] - 1000.0 * BATCH / solo["fast"], 0.0)


def replay(peers: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for k, result in peers.items():
        runs = result["runs"]
        for repeat, (solo, elche) in enumerate(zip(runs["solo"], runs.get("elche-cadence", []))):
            if not solo or not elche or elche["boundary_ms"] is None:
                continue
            ddp = runs.get("ddp", [None] * (repeat + 1))[repeat]
            elche_predicted, ddp_predicted = predict(solo, elche["boundary_ms"], allreduce_ms(peers, repeat), elche["samples"])
            rows.append({
                "k": k, "repeat": repeat, "elche": elche["samples_per_s"], "elche_predicted": elche_predicted,
                "ideal": solo["ideal"], "ddp": ddp["samples_per_s"] if ddp else None, "ddp_predicted": ddp_predicted,
                "sync_bound": solo["sync_bound"], "boundary_ms": elche["boundary_ms"],
            })
    return rows


def errors(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and largest absolute relative error of each predictor, over every repeat."""
    predictors = {
        "ElChe, simulator": ("elche", lambda r: r["elche_predicted"]),
        "ElChe, the ideal": ("elche", lambda r: r["ideal"]),
        f"ElChe, {TRIVIAL_SHARE:g} x the ideal": ("elche", lambda r: TRIVIAL_SHARE * r["ideal"]),
        "DDP, simulator": ("ddp", lambda r: r["ddp_predicted"]),
        "DDP, the synchronous bound": ("ddp", lambda r: r["sync_bound"]),
    }
    out = {}
    for name, (measured, guess) in predictors.items():
        values = [abs(guess(r) / r[measured] - 1.0) for r in rows if r[measured] and guess(r) is not None]
        if values:
            out[name] = {"median": statistics.median(values), "max": max(values), "n": len(values)}
    return out


def scale(world_sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for world in world_sizes:
        started = time.perf_counter()
        result = simulate_cohort(spread_speeds(world, 4.0), step_ms=100.0, noise=0.05, boundary_ms=20.0, steps=2000)
        rows.append({
            "ranks": world, "boundaries": len(result.boundaries), "controller_us_median": result.controller_us_median,
            "controller_us_max": result.controller_us_max, "wall_s": time.perf_counter() - started,
            "over_ddp": result.speedup_vs_ddp, "over_ideal": result.fraction_of_ideal,
        })
    return rows


def tables(record: dict[str, Any]) -> dict[str, str]:
    results = record["results"]
    replayed = ["| k | repeat | ElChe measured | simulator | error | the ideal | error | DDP measured | simulator | error "
                "| synchronous bound | error |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def err(guess: Optional[float], measured: Optional[float]) -> str:
        return "-" if guess is None or not measured else f"{guess / measured - 1:+.1%}"

    for r in results["replay"]:
        replayed.append(
            f"| {r['k']} | {r['repeat'] + 1} | {r['elche']:.0f} | {r['elche_predicted']:.0f} | {err(r['elche_predicted'], r['elche'])} "
            f"| {r['ideal']:.0f} | {err(r['ideal'], r['elche'])} | {r['ddp'] or 0:.0f} | "
            f"{'-' if r['ddp_predicted'] is None else format(r['ddp_predicted'], '.0f')} | {err(r['ddp_predicted'], r['ddp'])} "
            f"| {r['sync_bound']:.0f} | {err(r['sync_bound'], r['ddp'])} |"
        )
    summary = ["| predictor | median error | largest error | repeats |", "|---|---|---|---|"]
    summary += [f"| {name} | {e['median']:.1%} | {e['max']:.1%} | {e['n']} |" for name, e in results["errors"].items()]
    scaled = ["| ranks | boundaries | controller us per boundary (median / max) | simulation wall s | ElChe / DDP | ElChe / ideal |",
              "|---|---|---|---|---|---|"]
    scaled += [f"| {r['ranks']} | {r['boundaries']} | {r['controller_us_median']:.0f} / {r['controller_us_max']:.0f} | {r['wall_s']:.2f} "
               f"| {r['over_ddp']:.2f} | {r['over_ideal']:.2f} |" for r in results["scale"]]
    return {"replay": "\n".join(replayed) + "\n", "errors": "\n".join(summary) + "\n", "scale": "\n".join(scaled) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=Path, default=RESULTS / "peers.json", help="results of python -m benchmarks.peers")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 64, 256, 1024])
    parser.add_argument("--json", type=Path, default=RESULTS / "simulator_check.json")
    args = parser.parse_args()
    peers = json.loads(args.peers.read_text())
    rows = replay(peers["results"])
    results = {"peers_commit": peers["provenance"]["commit"], "replay": rows, "errors": errors(rows), "scale": scale(args.ranks)}
    record = json.loads(write_results(args.json, "simulator_check", args, results).read_text())
    for name, text in tables(record).items():
        print(f"\n{name}\n\n{text}")


if __name__ == "__main__":
    main()
