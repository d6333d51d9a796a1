"""Dynamic dispatch at 64-1024 ranks, in the cohort simulator: throughput and the store's load.

    python -m benchmarks.dispatch_sim        # about a minute

Speeds spread 4x geometrically, a lognormal noise of sigma 0.3 on every window, a 50 ms boundary;
steps of 100 ms (a large model) and 10 ms (a small one). Planned and dynamic dispatch side by
side, with the store at its defaults (0.2 ms round trip, 20 us of server time per operation) and a
slow one (1 ms, 100 us). Prints the fraction of the ideal (the sum of solo rates), ElChe over the
DDP estimate, the largest share of a rank's training time spent claiming, and the store's
utilisation; writes ``benchmarks/results/dispatch_sim.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.dispatch import provenance
from lightning_elche.sim.claims import claim_costs
from lightning_elche.sim.simulator import simulate_cohort, spread_speeds

REPO = Path(__file__).resolve().parent.parent
STORES = {"default store": (0.2, 20.0), "slow store": (1.0, 100.0)}


def case(ranks: int, step_ms: float, dispatch: str, claim_ms: float, store_op_us: float) -> dict[str, Any]:
    speeds = spread_speeds(ranks, 4.0)
    result = simulate_cohort(
        speeds, step_ms=step_ms, noise=0.3, boundary_ms=50.0, seconds=300 if step_ms >= 100 else 60,
        dispatch=dispatch, claim_ms=claim_ms, store_op_us=store_op_us,
    )  # fmt: skip
    row = {"fraction_of_ideal": result.fraction_of_ideal, "speedup_vs_ddp": result.speedup_vs_ddp}
    if dispatch == "dynamic":
        ms = [step_ms / s for s in speeds]
        load = claim_costs(ms, result.final_anchor * max(ms), claim_ms, store_op_us / 1000.0)
        row.update(claim_fraction_max=max(result.claim_fraction, default=0.0), store_utilisation=load.utilisation)
    return row


def main() -> None:
    rows: dict[str, dict[str, Any]] = {}
    print("| ranks | step | store | planned / ideal | dynamic / ideal | dynamic vs DDP | claiming (max rank) | store load |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in (64, 256, 1024):
        for step_ms in (100.0, 10.0):
            planned = case(ranks, step_ms, "planned", 0.0, 0.0)
            for store, (claim_ms, store_op_us) in STORES.items():
                dynamic = case(ranks, step_ms, "dynamic", claim_ms, store_op_us)
                rows[f"{ranks}/{step_ms:g}ms/{store}"] = {"planned": planned, "dynamic": dynamic}
                print(
                    f"| {ranks} | {step_ms:g} ms | {store} | {planned['fraction_of_ideal']:.2f} | "
                    f"{dynamic['fraction_of_ideal']:.2f} | {dynamic['speedup_vs_ddp']:.2f}x | "
                    f"{dynamic['claim_fraction_max']:.1%} | {dynamic['store_utilisation']:.2f} |",
                    flush=True,
                )
    path = REPO / "benchmarks" / "results" / "dispatch_sim.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "provenance": provenance(), "spread": "none: the simulator is seeded, every run prints the same figures",
        "cases": rows,
    }, indent=2))  # fmt: skip
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
