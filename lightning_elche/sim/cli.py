"""The cohort simulator's command line: ``python -m lightning_elche.simulate --speeds 1.0,0.5,0.25``.

Predicts ElChe's throughput, idle and overhead against DDP for those relative GPU speeds by
driving the strategy's own cohort core with simulated ranks (:mod:`lightning_elche.sim.simulator`),
prints the prediction (:mod:`lightning_elche.sim.results`) and optionally plots it
(:mod:`lightning_elche.sim.plot`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Optional, Sequence

from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.settings import DISPATCHES
from lightning_elche.sim import plot as sim_plot
from lightning_elche.sim.link import simulated_costs
from lightning_elche.sim.results import SimResult, SpeedChange
from lightning_elche.sim.simulator import SIMULATED_POLICIES, simulate_cohort, spread_speeds

LISTED_RANKS = 8  # beyond this many ranks, per-rank figures are summarised (min / median / max)
DEFAULT_STEPS = 2000


def _speed_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speeds takes comma-separated numbers such as 1.0,0.5,0.25, got {text!r}"
        ) from None


def _speed_change(text: str) -> SpeedChange:
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError(text)
        rank, step, speed = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speed-change takes RANK:STEP:SPEED such as 1:500:0.5, got {text!r}"
        ) from None
    return SpeedChange(rank=rank, at_step=step, speed=speed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_elche.sim.cli",
        description="Predict ElChe's throughput, idle and overhead against DDP for ranks of given speeds, "
        "driving ElChe's own cohort core (plan, controller, governor) with simulated ranks.",
        epilog="example: python -m lightning_elche.sim.cli --speeds 1.0,0.5,0.25 --step-ms 50 --noise 0.05 "
        "--boundary-ms 20 --batch-size 64 --steps 5000 --speed-change 0:2500:0.4 --plot run.png",
    )
    ranks = parser.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--speeds", type=_speed_list, help="relative speed per rank, comma-separated (1.0 = --step-ms)")
    ranks.add_argument("--ranks", type=int, help="simulate this many ranks, speeds spread by --spread")
    parser.add_argument("--spread", type=float, default=1.0,
                        help="with --ranks: fastest / slowest speed, spaced geometrically (default 1: equal ranks)")
    parser.add_argument("--step-ms", type=float, default=100.0, help="ms per optimizer step at speed 1.0 (default 100)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="sigma of the lognormal per-step noise (default 0.05)")
    parser.add_argument("--boundary-ms", type=float, default=10.0, help="fixed cost of a boundary in ms (default 10)")
    parser.add_argument("--boundary-ms-per-rank", type=float, default=0.0,
                        help="boundary cost added per rank, for collectives that grow with the world size")
    parser.add_argument("--allreduce-ms", type=float, default=None,
                        help="DDP's all-reduce per step in ms (default: the boundary cost, "
                             "--model-bytes instead of --boundary-bytes on the link)")
    parser.add_argument("--link-mbit-s", type=float, default=None,
                        help="bandwidth of the slowest link between ranks in Mbit/s: a boundary then also pays the "
                             "ring all-reduce of --boundary-bytes, and the controller sizes the anchor for it "
                             "(default: no link simulated)")
    parser.add_argument("--link-latency-ms", type=float, default=0.0,
                        help="the link's fixed cost per all-reduce in ms (needs --link-mbit-s; default 0)")
    parser.add_argument("--boundary-bytes", type=int, default=0,
                        help="bytes one ElChe boundary all-reduces on the link (compressed payload if compressed)")
    parser.add_argument("--model-bytes", type=int, default=None,
                        help="bytes DDP all-reduces per step on the link (fp32 gradients; default --boundary-bytes)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step per rank (default 64)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"cohort (DDP-equivalent) steps to run (default {DEFAULT_STEPS} without --seconds/--epochs)")
    parser.add_argument("--seconds", type=float, default=None, help="simulated training seconds to run")
    parser.add_argument("--epochs", type=int, default=None, help="epochs to run (needs --epoch-samples)")
    parser.add_argument("--epoch-samples", type=int, default=None,
                        help="samples per epoch: windows stop at epoch ends (default: one endless epoch)")
    parser.add_argument("--speed-change", type=_speed_change, action="append", default=[], metavar="RANK:STEP:SPEED",
                        help="rank RANK runs at SPEED from cohort step STEP on (repeatable)")
    parser.add_argument("--policy", choices=SIMULATED_POLICIES, default="cadence")
    parser.add_argument("--anchor", type=int, default=10, help="initial steps per window of the slowest rank")
    parser.add_argument("--min-anchor", type=int, default=None)
    parser.add_argument("--max-anchor", type=int, default=1000)
    parser.add_argument("--overhead-target", type=float, default=0.05)
    parser.add_argument("--max-batch-diff", type=int, default=None)
    parser.add_argument("--lookahead", type=int, default=1,
                        help="batches the DataLoader prefetches (1 + num_workers * prefetch_factor; default 1)")
    parser.add_argument("--dispatch", choices=DISPATCHES, default="auto",
                        help="ranks claiming steps from each window's pool (dynamic), shares planned a window "
                             "ahead (planned), or auto (default): dynamic unless --policy sync")
    parser.add_argument("--claim-ms", type=float, default=0.2,
                        help="dynamic dispatch: a store operation's network round trip in ms (default 0.2)")
    parser.add_argument("--store-op-us", type=float, default=20.0,
                        help="dynamic dispatch: the store server's time per operation in us (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write shares and anchor over time (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, per-boundary records included")
    return parser


def _percent(value: float) -> str:
    return f"{value:.1%}"


def _per_rank(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """Every rank for small cohorts, min / median / max (and the worst rank) for large ones."""
    if len(values) <= LISTED_RANKS:
        return "  ".join(f"{rank}: {fmt(v)}" for rank, v in enumerate(values))
    worst = max(range(len(values)), key=lambda r: (values[r], -r))
    return (
        f"min {fmt(min(values))}  median {fmt(statistics.median(values))}  max {fmt(values[worst])} (rank {worst})"
    )


def describe_link(
    link_mbit_s: float, link_latency_ms: float, boundary_bytes: int, model_bytes: Optional[int]
) -> str:
    """The simulated link and what crosses it, for the report: the boundary cost above includes it."""
    ddp_bytes = boundary_bytes if model_bytes is None else model_bytes
    return (
        f"link {link_mbit_s:g} Mbit/s, {link_latency_ms:g} ms latency: {boundary_bytes / 1e6:g} MB per boundary, "
        f"{ddp_bytes / 1e6:g} MB per DDP step (both included above)"
    )


def format_report(
    result: SimResult, boundary_ms: float, allreduce_ms: float, noise: float, step_ms: float,
    link: Optional[str] = None,
) -> str:
    """The CLI's table: predicted throughput against DDP and the ideal, idle, overhead, final plan, controller cost.

    ``link`` (from :func:`describe_link`) is printed under the costs when a link was simulated.
    """
    ddp, world = result.ddp, result.world_size
    speeds = _per_rank(result.speeds, lambda v: f"{v:g}")
    lines = [
        f"ElChe cohort simulation: {world} ranks, speeds {speeds}",
        f"  step {step_ms:g} ms at speed 1, noise {noise:g}, boundary {boundary_ms:g} ms, DDP all-reduce "
        f"{allreduce_ms:g} ms/step, batch {result.batch_size}",
        *([f"  {link}"] if link is not None else []),
        f"  {result.cohort_steps} cohort steps in {result.seconds:.1f} s simulated, {len(result.boundaries)} boundaries",
        "",
        f"  {'':<18}{'samples/s':>12}{'vs ideal':>10}{'mean idle':>11}{'overhead':>10}",
        f"  {'ElChe (predicted)':<18}{result.samples_per_s:>12.0f}{result.fraction_of_ideal:>10.2f}"
        f"{_percent(statistics.fmean(result.idle_fraction)):>11}{_percent(result.overhead_fraction):>10}",
        f"  {'DDP (estimate)':<18}{ddp.samples_per_s:>12.0f}{ddp.samples_per_s / result.ideal_samples_per_s:>10.2f}"
        f"{_percent(statistics.fmean(ddp.idle_fraction)):>11}{_percent(ddp.overhead_fraction):>10}",
        f"  {'ideal':<18}{result.ideal_samples_per_s:>12.0f}{1.0:>10.2f}",
        f"  ElChe vs DDP: {result.speedup_vs_ddp:.2f}x",
        "",
        f"  idle per rank (ElChe): {_per_rank(result.idle_fraction, _percent)}",
        *([f"  dispatch dynamic, claiming per rank: {_per_rank(result.claim_fraction, _percent)}"]
          if result.claim_ms else []),
        f"  final anchor {result.final_anchor} (anchor rank {result.anchor_rank}), "
        f"shares {_per_rank(result.final_shares, lambda v: f'{v:.3g}')}",
        f"  controller cost per boundary at {world} ranks: median {result.controller_us_median:.0f} us, "
        f"max {result.controller_us_max:.0f} us ({result.wall_s:.2f} s to simulate)",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_elche.sim.cli``: run the cohort simulator and print (or plot) what it predicts."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot is not None and not sim_plot.matplotlib_available():
        parser.error("--plot needs matplotlib, which lightning-elche does not install: pip install matplotlib")
    if not 1 <= args.anchor <= args.max_anchor:
        parser.error(f"--anchor must be between 1 and --max-anchor ({args.max_anchor}), got {args.anchor}")
    if not 0.0 < args.overhead_target < 1.0:
        parser.error(f"--overhead-target must be in (0, 1), got {args.overhead_target}")
    try:
        speeds = args.speeds if args.speeds is not None else spread_speeds(args.ranks, args.spread)
        config = ControllerConfig(
            world_size=len(speeds), policy=args.policy, anchor=args.anchor, min_anchor=args.min_anchor,
            max_anchor=args.max_anchor, overhead_target=args.overhead_target, max_batch_diff=args.max_batch_diff,
        )
        steps = args.steps
        if steps is None and args.seconds is None and args.epochs is None:
            steps = DEFAULT_STEPS
        result = simulate_cohort(
            speeds, step_ms=args.step_ms, noise=args.noise, boundary_ms=args.boundary_ms,
            boundary_ms_per_rank=args.boundary_ms_per_rank, allreduce_ms=args.allreduce_ms,
            batch_size=args.batch_size, steps=steps, seconds=args.seconds, epochs=args.epochs,
            epoch_samples=args.epoch_samples, speed_changes=args.speed_change, config=config,
            lookahead_batches=args.lookahead, seed=args.seed, dispatch=args.dispatch, claim_ms=args.claim_ms,
            store_op_us=args.store_op_us, link_mbit_s=args.link_mbit_s, link_latency_ms=args.link_latency_ms,
            boundary_bytes=args.boundary_bytes, model_bytes=args.model_bytes,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(result.as_dict(boundaries=True)))
    else:
        boundary_cost, allreduce = simulated_costs(
            len(speeds), args.boundary_ms, args.boundary_ms_per_rank, args.allreduce_ms, args.link_mbit_s,
            args.link_latency_ms, args.boundary_bytes, args.model_bytes,
        )
        link = None if args.link_mbit_s is None else describe_link(
            args.link_mbit_s, args.link_latency_ms, args.boundary_bytes, args.model_bytes
        )
        print(format_report(result, boundary_cost, allreduce, args.noise, args.step_ms, link))
    if args.plot is not None:
        sim_plot.plot(result, args.plot)
        if not args.json:
            print(f"  plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
