"""The cohort simulator's picture: each rank's share and the anchor over the simulated clock.

Needs matplotlib, which is not a dependency of lightning-elche; :func:`matplotlib_available` lets
the command line refuse ``--plot`` before a long simulation rather than after it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Union

from lightning_elche.sim.results import SimResult


def matplotlib_available() -> bool:
    """Whether :func:`plot` can run; checked before a long simulation rather than after it."""
    return importlib.util.find_spec("matplotlib") is not None


PLOTTED_RANKS = 8  # beyond this many ranks the plot shows the fastest, median and slowest rank


def plot(result: SimResult, path: Union[str, Path]) -> None:
    """Write a PNG of each rank's share and of the anchor over the simulated clock.

    Needs matplotlib, which is not a dependency of lightning-elche (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from error

    times = [b.time_s for b in result.boundaries]
    world = result.world_size
    if world <= PLOTTED_RANKS:
        shown = list(range(world))
    else:
        by_speed = sorted(range(world), key=lambda r: (-result.speeds[r], r))
        shown = [by_speed[0], by_speed[world // 2], by_speed[-1]]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for rank in shown:
        top.step(times, [b.shares[rank] for b in result.boundaries], where="pre",
                 label=f"rank {rank} (speed {result.speeds[rank]:.3g})")
    top.set_ylabel("share of the window's samples")
    top.legend(fontsize="small")
    top.set_title(
        f"{world} ranks: {result.samples_per_s:.0f} samples/s, {result.speedup_vs_ddp:.2f}x DDP, "
        f"{result.fraction_of_ideal:.0%} of ideal"
    )
    bottom.step(times, [b.anchor for b in result.boundaries], where="pre", color="black")
    bottom.set_ylim(0, max(b.anchor for b in result.boundaries) * 1.1 + 1)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("anchor (steps per window)")
    bottom.set_xlabel("simulated training time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
