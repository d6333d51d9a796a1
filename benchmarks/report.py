"""Plots for benchmarks/README.md from the peers benchmark's JSON.

    pip install -e ".[bench]"                      # matplotlib
    python -m benchmarks.report                    # writes benchmarks/plots/*.png (and the docs site's copies)

Reads ``benchmarks/results/peers.json`` (``python -m benchmarks.peers``) and draws each
configuration's throughput against the slowdown k beside the ideal and the synchronous bound, and
test accuracy against training-clock seconds at the largest k (one line per repeat).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS_IMAGES = HERE.parent / "docs" / "img"  # the site cannot reach benchmarks/: it shows copies
COLORS = {
    "fast-alone": "black", "ddp": "tab:red", "post-local-sgd": "tab:orange", "torchft-localsgd": "tab:purple",
    "torchft-diloco": "tab:pink", "hivemind": "tab:brown", "elche-cadence": "tab:blue", "elche-async": "tab:cyan",
    "elche-outer": "tab:green",
}


def plot_throughput(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    slowdowns = sorted(results, key=float)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for reference, style in (("ideal", "--"), ("sync_bound", ":")):
        values = [results[k]["summary"][reference]["median"] for k in slowdowns]
        label = "ideal (solo rates summed)" if reference == "ideal" else "synchronous bound"
        axes.plot([float(k) for k in slowdowns], values, color="gray", linestyle=style, label=label)
    for name, color in COLORS.items():
        points = [(float(k), results[k]["summary"][name]["samples_per_s"]["median"]) for k in slowdowns
                  if (results[k]["summary"].get(name) or {}).get("samples_per_s")]
        if points and name != "fast-alone":
            axes.plot(*zip(*points), marker="o", color=color, label=name)
    axes.set_xlabel("slowdown k of rank 1")
    axes.set_ylabel("samples / s (both ranks)")
    axes.set_xticks([float(k) for k in slowdowns])
    axes.set_ylim(bottom=0)
    axes.set_title("Throughput on uneven ranks (2 CPU processes, small CNN, Fashion-MNIST)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def plot_accuracy(runs: dict, k: str, target: float, out: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, repeats in runs.items():
        for index, run in enumerate(r for r in repeats if r and name != "solo"):
            curve = run.get("curve") or []
            if curve:
                axes.plot([p[0] for p in curve], [100 * p[2] for p in curve], color=COLORS.get(name, "gray"), alpha=0.8,
                          label=name if index == 0 else None)
    axes.axhline(100 * target, color="gray", linestyle=":", label=f"target {100 * target:.0f} %")
    axes.set_xlabel("training-clock seconds")
    axes.set_ylabel("test accuracy (%)")
    axes.set_ylim(70, 90)
    axes.set_title(f"Fashion-MNIST, rank 1 {k} times slower (one line per repeat)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "peers.json")
    parser.add_argument("--out", type=Path, default=HERE / "plots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = json.loads(args.results.read_text())
    results = record["results"]
    plot_throughput(results, args.out / "throughput.png")
    largest = max(results, key=float)
    plot_accuracy(results[largest]["runs"], largest, float(record["args"]["target"]), args.out / "time_to_accuracy.png")
    if args.out == HERE / "plots":  # the README's plots: the docs site shows copies
        publish(args.out / "throughput.png")
        publish(args.out / "time_to_accuracy.png")


def publish(plot: Path) -> None:
    copy = DOCS_IMAGES / f"benchmark-{plot.stem.replace('_', '-')}.png"
    shutil.copyfile(plot, copy)
    print(f"wrote {plot} and {copy}")


if __name__ == "__main__":
    main()
