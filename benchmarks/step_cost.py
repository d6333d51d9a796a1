"""ElChe's own cost per training step, beside the step: what its hooks, claims and bookkeeping take.

    python -m benchmarks.step_cost             # 4 models x 2 ways of claiming x 2 repeats; about 4 minutes
    python -m benchmarks.step_cost --smoke --json /tmp/step_cost.json   # every model once, tiny

Two ranks at equal speed (gloo, one thread each) train one epoch under ``ElCheStrategy()``'s defaults
(dynamic dispatch). On every rank the benchmark times, with ``time.perf_counter`` wrappers around the
library's own entry points, what ElChe does at every step outside its boundaries:

  hooks     ``ElCheCallback.on_train_batch_start`` / ``on_train_batch_end`` (the window's clock, the
            logged step, the stop request, the progress bar), the boundaries they run taken out;
  step      ``Cohort.optimizer_stepped`` (the window's step count) after each optimizer step;
  claims    what the training thread spends claiming: sending a claim (``TicketCounter.claim_later``),
            waiting for its answer (``PendingClaim.first``) and ``peek``, dynamic dispatch's reads of
            the rendezvous store.

Each model runs twice per repeat, side by side: claims sent ahead (the product: the next claim goes out
as the last ticket held is handed out, answered on the store's thread while the step trains) and
``at-need`` (each claim made when the DataLoader asks for the ticket, as before: the
benchmark turns ``Claiming.ahead`` off).

Reported per model: each part in microseconds per step and, summed, as a share of a training step
(the training clock's time outside boundaries over its optimizer steps). Models: ``cnn`` (the small
CNN of ``benchmarks/fashion.py``, batch 32, Adam), ``mlp1024`` (64-1024-1024-10, batch 128, SGD:
``benchmarks/alternation.py``'s), ``mlp256`` (784-256-256-10, batch 64, Adam: a step of a few ms, as
on a GPU) and ``charlm`` (the char LM of ``examples/char_lm.py`` at half size, batch 32, AdamW), on
generated data (the char LM on its bundled text).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/step_cost.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dispatch import Rows, recorder
from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.step_cost"
MODELS = ("cnn", "mlp1024", "mlp256", "charlm")
CLAIMS = ("ahead", "at-need")
PARTS = ("hooks", "step", "claims")
SMOKE = {"repeats": 1, "samples": 1024, "timeout": 180.0}


def model_and_data(name: str, samples: int) -> tuple[nn.Module, Dataset, int, Callable[[nn.Module], torch.optim.Optimizer]]:
    """(network, train set, batch size, optimizer factory) of one of ``MODELS``."""
    torch.manual_seed(0)
    if name == "charlm":
        from benchmarks import tta_tasks

        train = tta_tasks.charlm_data(samples)[0]
        return tta_tasks.charlm_network(), train, 32, lambda net: torch.optim.AdamW(net.parameters(), lr=3e-3)
    if name == "mlp1024":
        x = torch.randn(samples, 64)
        net: nn.Module = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return net, TensorDataset(x, torch.randint(0, 10, (samples,))), 128, lambda net: torch.optim.SGD(net.parameters(), lr=0.05)
    images = torch.rand(samples, 1, 28, 28)
    labels = torch.randint(0, 10, (samples,))
    if name == "cnn":
        from benchmarks.fashion import small_cnn

        return small_cnn(), TensorDataset(images, labels), 32, lambda net: torch.optim.Adam(net.parameters(), lr=1e-3)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return net, TensorDataset(images, labels), 64, lambda net: torch.optim.Adam(net.parameters(), lr=1e-3)


class Timed:
    """Seconds spent in the wrapped functions, per part; a wrapper inside another's call (a boundary
    inside ``on_train_batch_end``) is taken out of the outer part."""

    def __init__(self) -> None:
        self.seconds = {part: 0.0 for part in (*PARTS, "boundary")}
        self.calls = {part: 0 for part in self.seconds}
        self._inner = 0.0

    def wrap(self, owner: type, name: str, part: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            outer_inner, self._inner = self._inner, 0.0
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                self.seconds[part] += spent - self._inner
                self.calls[part] += 1
                self._inner = outer_inner + spent

        setattr(owner, name, timed)


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, TrainClock, write_report
    from lightning_elche.cohort.core import Cohort
    from lightning_elche.comm.claims import PendingClaim, TicketCounter
    from lightning_elche.lightning.callback import ElCheCallback
    from lightning_elche.lightning.session import FitSession

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    timed = Timed()
    timed.wrap(ElCheCallback, "on_train_batch_start", "hooks")
    timed.wrap(ElCheCallback, "on_train_batch_end", "hooks")
    timed.wrap(ElCheCallback, "_boundary", "boundary")
    timed.wrap(Cohort, "optimizer_stepped", "step")
    timed.wrap(TicketCounter, "claim_later", "claims")
    timed.wrap(PendingClaim, "first", "claims")
    timed.wrap(TicketCounter, "peek", "claims")
    if config["claims"] == "at-need":
        claiming = FitSession.claiming
        FitSession.claiming = lambda session: dataclasses.replace(claiming(session), ahead=False)
    net, train, batch_size, optimizer = model_and_data(config["model"], config["samples"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self.net(x)
            return nn.functional.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y.flatten() if out.dim() == 3 else y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.net)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True)

    clock = TrainClock()
    trainer = pl.Trainer(devices=2, strategy=ElCheStrategy(timeout=120), max_epochs=1, limit_val_batches=0,
                         callbacks=[clock], **QUIET_TRAINER)
    trainer.fit(Module())
    write_report(config["out"], trainer.global_rank, {"seconds": dict(timed.seconds), "train_s": clock.seconds,
                                                      "steps": timed.calls["step"]})


def run(args: argparse.Namespace, model: str, claims: str) -> dict[str, Any]:
    """One fit: per rank, each part's microseconds per step, and their sum over a step's time."""
    config = {"name": f"{model}-{claims}", "model": model, "claims": claims, "samples": args.samples}
    reports = run_job(MODULE, worker, config, ranks=2, timeout=args.timeout, warm=args.smoke)
    row: dict[str, Any] = {}
    for part in PARTS:
        row[f"{part}_us"] = max(r["seconds"][part] / r["steps"] * 1e6 for r in reports)
    step_s = [(r["train_s"] - r["seconds"]["boundary"]) / r["steps"] for r in reports]
    row["step_ms"] = 1000 * sum(step_s) / len(step_s)
    row["share"] = max(sum(r["seconds"][p] for p in PARTS) / (r["train_s"] - r["seconds"]["boundary"]) for r in reports)
    return row


def measure(args: argparse.Namespace, failures: Failures) -> Rows:
    rows: Rows = {}
    record = recorder(rows, args.repeats, failures, 8)
    for repeat in range(args.repeats):
        print(f"--- repeat {repeat + 1} of {args.repeats}", flush=True)
        for model, claims in rotated([(m, c) for m in args.models for c in args.claims], repeat):
            record(f"{model} {claims}", repeat, lambda m=model, c=claims: run(args, m, c))
    return rows


def summary(rows: Rows) -> dict[str, Any]:
    out = {}
    for model, runs in rows.items():
        done = [r for r in runs if r]
        if done:
            out[model] = {key: spread([r[key] for r in done]) for key in done[0]}
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """Per model, medians (min-max) over the repeats; a rank's figure is the larger of the two ranks'."""
    medians, runs = record["results"]["summary"], record["results"]["runs"]
    lines = ["| model, claims | step (ms) | hooks (us/step) | step count (us/step) | claims (us/step) | ElChe's share of a step |",
             "|---|---|---|---|---|---|"]
    for model in runs:
        row = medians.get(model)
        if row is None:
            lines.append(f"| {model} | failed ({failed(record, model)} of {len(runs[model])} runs) | | | | |")
            continue
        lines.append(f"| {model} | {cell(row['step_ms'], '.1f')} | {cell(row['hooks_us'], '.0f')} | {cell(row['step_us'], '.0f')} "
                     f"| {cell(row['claims_us'], '.0f')} | {cell(row['share'], '.1f', 100, ' %')} |")
    return {"step_cost": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every model once, tiny: does everything run?")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12800, help="samples (char LM: blocks) in the epoch")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--claims", nargs="+", default=list(CLAIMS), choices=CLAIMS, help="claims sent ahead, or at need")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/step_cost.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("step_cost", args)
    failures = Failures()
    rows = measure(args, failures)
    conclude("step_cost", args, {"summary": summary(rows), "runs": rows}, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
