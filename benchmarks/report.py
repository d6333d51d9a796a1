"""Plots for benchmarks/README.md from the benchmarks' JSON results.

    pip install -e ".[bench]"                      # matplotlib
    python benchmarks/report.py                    # writes benchmarks/plots/*.png (and the docs site's copies)

Reads ``benchmarks/results/throughput.json`` (``throughput.py``) and
``benchmarks/results/time_to_accuracy.json`` (``time_to_accuracy.py``), whichever exist, and draws
throughput against the slowdown (DDP, ElChe, the ideal) and test accuracy against training-clock
seconds (every configuration, one line per seed).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS_IMAGES = HERE.parent / "docs" / "img"  # the site cannot reach benchmarks/: it shows copies
COLORS = {
    "fast-alone": "black", "ddp": "tab:red", "elche-sync": "tab:orange", "elche-cadence": "tab:blue",
    "elche-async": "tab:cyan", "elche-outer": "tab:green",
}


def plot_throughput(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    slowdowns = sorted(results, key=float)
    rates = {name: [results[k]["median_samples_per_s"][name] for k in slowdowns] for name in ("ideal", "elche", "ddp")}
    labels = {"ideal": "ideal (sum of solo rates)", "elche": "ElChe cadence", "ddp": "Lightning DDP"}
    styles = {"ideal": ("gray", "--"), "elche": ("tab:blue", "-"), "ddp": ("tab:red", "-")}
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, values in rates.items():
        color, line = styles[name]
        axes.plot([float(k) for k in slowdowns], values, marker="o", color=color, linestyle=line, label=labels[name])
    axes.set_xlabel("slowdown k of rank 1")
    axes.set_ylabel("samples / s (both ranks)")
    axes.set_xticks([float(k) for k in slowdowns])
    axes.set_ylim(bottom=0)
    axes.set_title("Throughput on uneven ranks (2 CPU processes, small CNN)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def plot_accuracy(results: dict, target: float, out: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, runs in results.items():
        for index, run in enumerate(runs):
            curve = run.get("curve") or []
            if not curve:
                continue
            seconds = [point[0] for point in curve]
            accuracy = [100 * point[2] for point in curve]
            axes.plot(seconds, accuracy, color=COLORS.get(name, "gray"), alpha=0.8, label=name if index == 0 else None)
    axes.axhline(100 * target, color="gray", linestyle=":", label=f"target {100 * target:.0f} %")
    axes.set_xlabel("training-clock seconds")
    axes.set_ylabel("test accuracy (%)")
    axes.set_ylim(75, 90)
    axes.set_title("Fashion-MNIST, rank 1 three times slower (one line per seed)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE / "plots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    throughput = args.results / "throughput.json"
    if throughput.exists():
        plot_throughput(json.loads(throughput.read_text())["results"], args.out / "throughput.png")
        publish(args.out / "throughput.png")
    accuracy = args.results / "time_to_accuracy.json"
    if accuracy.exists():
        data = json.loads(accuracy.read_text())
        plot_accuracy(data["results"], float(data["args"]["target"]), args.out / "time_to_accuracy.png")
        publish(args.out / "time_to_accuracy.png")


def publish(plot: Path) -> None:
    copy = DOCS_IMAGES / f"benchmark-{plot.stem.replace('_', '-')}.png"
    shutil.copyfile(plot, copy)
    print(f"wrote {plot} and {copy}")


if __name__ == "__main__":
    main()
