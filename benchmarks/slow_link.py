"""Slow links: compressed and streamed boundaries against full-precision ones, and DDP, on a simulated
100 Mbit/s and 1 Gbit/s link, time to accuracy on two tasks, from one command.

    python -m benchmarks.slow_link                      # both tasks, both links, 1 repeat: ~40 min here
    python -m benchmarks.slow_link --smoke              # DDP and three ElChe settings, tiny (tests)
    python -m benchmarks.slow_link --tasks fashion --links 100 --repeats 2
    python -m benchmarks.slow_link --real-link --tasks mlp --links 100 1000   # also on a real link (root)
    python -m benchmarks.slow_link --smoke --real-link  # the real-link comparison, tiny (tests)

Tasks (each one epoch, two rank processes on this machine's two cores, gloo, one thread each, rank 1
made ``--slowdown`` (2) times slower by ``lightning_elche.Slowdown``):

  fashion   the small CNN of ``benchmarks/fashion.py`` (215k parameters) on Fashion-MNIST's 60k
            images, batch 64 per rank, Adam 1e-3; scored by test accuracy (10k images)
  mlp       a two-layer MLP (784-256-256-10, 269k parameters, 1.08 MB a boundary) on the same
            images, batch 64, Adam 1e-3: a step of a few ms, as a GPU's step of the CNN would be,
            so the link, not the arithmetic, is what a boundary costs (the regime slow links are
            about; on these CPU ranks the CNN's and the char LM's steps take 20-90 ms)
  charlm    the character-level GPT of ``examples/char_lm.py`` at half its depth and context
            (2 layers, 128 wide, 64 characters: 0.4M parameters) on 19,200 blocks of Shakespeare,
            batch 32, AdamW with warmup and cosine decay (the example's full size takes 10 minutes
            a run here); scored by next-character accuracy on 256 held-out blocks (16k characters)

Configurations:

  ddp             Lightning ``strategy="ddp"``; every gradient bucket's all-reduce held for its
                  bytes on the link (a DDP communication hook, registered by
                  ``benchmarks.peers_lightning.CommHook``: Lightning drops ``ddp_comm_hook`` on CPU)
  elche           ``ElCheStrategy(simulated_link=...)``: full-precision parameters every boundary
  elche-bf16      ``compression="bf16"``
  elche-int8      ``compression="int8"`` (block-scaled, error feedback)
  elche-int8-f4   ``compression="int8", fragments=4``: one quarter of the model per boundary
  elche-h8, elche-int8-f4-h8   the same two with the window fixed at 8 steps of the slowest rank
                  (``anchor=8, max_anchor=8``), as a DiLoCo user fixes H: the controller can no
                  longer hide the link's cost behind longer windows
  elche-sync, elche-sync-int8, elche-sync-int8-f4   ``policy="sync"``: an average after every step
                  (DDP's optimisation with plain SGD), where the link's cost is paid every step

The link is :class:`lightning_elche.SlowLink` (``--latency-ms`` 1 ms): each boundary collective
(each DDP bucket) waits, after it returns, for its bytes at the link's rate; the controller is told
the link, as a user would with ``link_mbit_s``. Every configuration trains the same samples, so
"final" is accuracy at equal samples; "to target" is training-clock seconds to the task's target
(``--fashion-target`` and ``--mlp-target`` 0.84, ``--charlm-target`` 0.35); every model copy (one
per ``--eval-every-s``: 1 s for fashion, 0.5 s for mlp, 3 s for charlm, at the first consensus
after each) is scored, so the curves are in the results file. Ratios are paired within a repeat:
the reference is the full-precision configuration of the same policy and window on the
same link (``elche-int8-f4-h8`` against ``elche-h8``; DDP against ``elche``). Bytes per boundary
are what rank 0 sent, counted by the comm layer.

``--real-link`` (root: ``benchmarks/netrig.py``) runs every configuration a second time in each
repeat, its two ranks on two hosts made of network namespaces whose link ``tc``'s token bucket
limits to the rate, gloo's TCP crossing it, no ``SlowLink`` (the controller told the link with
``link_mbit_s``, as a user would), and checks the simulation against it: training seconds and the
cost of a boundary (the cheapest rank's: the last to arrive waits for nobody) with ``SlowLink``
against the real link, and the link model that ``SlowLink``, the controller and the cohort simulator
share (``lightning_elche/cohort/link.py``) against the part of a real boundary the link took (the
real boundary minus the same configuration's local cost, its ``SlowLink`` boundary less the model's
time). The rig adds no latency (no ``netem``), so both sides run at ``--latency-ms 0``. Also
reported: the averaging overhead the controller reached on the real link (a boundary's cost over the
slow rank's window and the boundary, median of the fit's second half), against ``overhead_target``
(5 %), and the link's TCP goodput, measured before the runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/slow_link.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fashion import ModelCopies, accuracy, choose_data, load_data, small_cnn, subset
from benchmarks.harness import cell, conclude, results_path, run_job
from benchmarks.peers_lightning import CommHook, ConsensusCopies
from benchmarks.provenance import REPO, Failures, rotated, spread
from lightning_elche._jobs import QUIET_TRAINER, Classifier, JobFailed, main_or_worker, write_report
from lightning_elche.cohort.link import transfer_ms
from lightning_elche.sim.slowdown import Slowdown, SlowLink

MODULE = "benchmarks.slow_link"
FIXED_WINDOW = {"anchor": 8, "max_anchor": 8}  # a DiLoCo-style fixed period: the link's cost is not amortized away
CONFIGS = {
    "ddp": None,
    "elche": {},
    "elche-bf16": {"compression": "bf16"},
    "elche-int8": {"compression": "int8"},
    "elche-int8-f4": {"compression": "int8", "fragments": 4},
    "elche-h8": FIXED_WINDOW,
    "elche-int8-f4-h8": {"compression": "int8", "fragments": 4, **FIXED_WINDOW},
    "elche-sync": {"policy": "sync"},
    "elche-sync-int8": {"policy": "sync", "compression": "int8"},
    "elche-sync-int8-f4": {"policy": "sync", "compression": "int8", "fragments": 4},
}
TASKS = ("fashion", "mlp", "charlm")
IMAGE_TASKS = ("fashion", "mlp")
# block, dim, layers, heads, batch size, training blocks, warmup steps, peak learning rate: the
# example's model at half its depth and context and three quarters of its blocks: a minute or two a run
CHARLM_SIZE = (64, 128, 2, 4, 32, 19_200, 20, 3e-3)
CHARLM_EVAL_BLOCKS = 256
EVAL_EVERY_S = {"fashion": 1.0, "mlp": 0.5, "charlm": 3.0}  # training-clock seconds between model copies
SMOKE = {"tasks": ["mlp", "charlm"], "train_samples": 512, "charlm_blocks": 256, "links": [100.0], "repeats": 1,
         "mlp_target": 0.5, "charlm_target": 0.2, "eval_every_s": 2.0, "timeout": 240,
         "configs": ["ddp", "elche", "elche-int8-f4-h8", "elche-sync-int8"]}  # every code path once
# The char LM's model and scoring once: each job is mostly two fresh interpreters' start (about 20 s of CPU),
# so eight jobs took 203 s unloaded and ran past the suite's 300 s hang guard with both cores busy.
SMOKE_TASK_CONFIGS = {"charlm": ["elche"]}
# sync: a boundary after every step, so the number of boundaries compared does not hang on the machine's load
# (the default policy's window grows with the known link and may leave a tiny run one or two boundaries)
SMOKE_REAL_LINK = {**SMOKE, "tasks": ["mlp"], "configs": ["ddp", "elche-sync"], "goodput_bytes": 2_500_000}
RIG_PORT = 29621  # the rendezvous of a job across the rig's hosts (their own network: no clash with the machine's)
OVERHEAD_TARGET = 0.05  # ElCheStrategy's default, which every configuration here keeps


def char_lm_module() -> Any:
    """``examples/char_lm.py``, imported from its file (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("char_lm", REPO / "examples" / "char_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def charlm_data(blocks: Optional[int]) -> tuple[Any, Any, TensorDataset, int]:
    """(the example's module, its training blocks, held-out blocks as tensors, vocabulary size)."""
    char_lm = char_lm_module()
    block, *_, default_blocks, _, _ = CHARLM_SIZE
    text = char_lm.load_plays()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    cut = int(0.9 * len(data))
    train = char_lm.Blocks(data[:cut], block, blocks or default_blocks)
    held_out = char_lm.Blocks(data[cut:], block, CHARLM_EVAL_BLOCKS)
    pairs = [held_out[i] for i in range(len(held_out))]
    test = TensorDataset(torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]))
    return char_lm, train, test, len(chars)


def slow_allreduce_hook(link: SlowLink) -> Any:
    """A DDP communication hook: the bucket's all-reduce, then its bytes held on ``link``."""
    import torch.distributed as dist

    def hook(state, bucket):  # unannotated: DDP refuses annotations other than its own classes
        tensor = bucket.buffer()
        world = dist.get_world_size()
        work = dist.all_reduce(tensor.div_(world), async_op=True)
        seconds = link.seconds(2 * (world - 1) * tensor.numel() * tensor.element_size() // world)

        def held(future: torch.futures.Future) -> torch.Tensor:
            time.sleep(seconds)
            return future.value()[0]

        return work.get_future().then(held)

    return hook


def strategy(name: str, link: SlowLink, real: bool) -> Any:
    """The configuration's strategy: on a real link the controller is told the link (``link_mbit_s``),
    as a user would; on the simulated one every boundary collective is held on ``link``."""
    from lightning_elche import ElCheStrategy

    if name == "ddp":
        return "ddp"
    if real:
        return ElCheStrategy(timeout=120, link_mbit_s=link.mbit_s, **CONFIGS[name])
    return ElCheStrategy(timeout=120, simulated_link=link, **CONFIGS[name])


class BytesSent(pl.Callback):
    """What this rank's boundaries sent over the fit (read before the strategy's teardown drops the averager)."""

    total: Optional[int] = None

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from lightning_elche import ElCheStrategy

        if isinstance(trainer.strategy, ElCheStrategy):  # DDP's all-reduces are not counted
            session = trainer.strategy.session
            assert session is not None, "BytesSent reads the fit's averager before the strategy's teardown"
            self.total = session.averager.wire.total_sent_bytes


def worker(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(config["seed"], verbose=False)
    link = SlowLink(config["link_mbit_s"], config["latency_ms"])
    real = config["real_link"]  # one rank on each of two namespace hosts, launched by run_across_hosts
    clock = ConsensusCopies(ModelCopies(config["eval_every_s"], budget_s=1e9))
    bytes_sent = BytesSent()
    trainer = pl.Trainer(
        devices=1 if real else 2, num_nodes=2 if real else 1, strategy=strategy(config["name"], link, real),
        max_epochs=1, limit_val_batches=0,
        callbacks=[
            clock, bytes_sent, Slowdown({1: config["slowdown"]}),
            *([CommHook(None, slow_allreduce_hook(link))] if config["name"] == "ddp" and not real else []),
        ],
        gradient_clip_val=1.0 if config["task"] == "charlm" else None,
        **QUIET_TRAINER,
    )  # fmt: skip
    if config["task"] in IMAGE_TASKS:
        train = subset(load_data(config["data"])[0], config["train_samples"])
        model: pl.LightningModule = Classifier(image_net(config["task"], train), train, batch_size=64, lr=1e-3)
    else:
        model = charlm_task(config)
    trainer.fit(model)
    if trainer.global_rank == 0:
        clock.copies.finish(model.net, clock.seconds, clock.cohort_samples, config["snapshots"])
    records = getattr(trainer.strategy, "boundaries", None) or []
    write_report(config["out"], trainer.global_rank, {
        "seconds": clock.seconds, "samples": clock.samples, "boundaries": clock.boundaries_seen,
        "sent_bytes": bytes_sent.total, "final_anchor": records[-1].anchor if records else None,
        "boundary_ms": clock.boundary_ms, "overheads": overheads(records),
    })  # fmt: skip


def overheads(records: list[Any]) -> list[float]:
    """Each boundary's averaging overhead as the controller defines it: the cheapest rank's boundary time
    (the last to arrive waits for nobody) over the slow rank's window and the boundary. A boundary's
    times are in the record after it (``previous_boundary_ms``, every rank's)."""
    shares = []
    for record, after in zip(records, records[1:]):
        cost, window = min(after.previous_boundary_ms), max(record.window_ms)
        if cost > 0 and window > 0:
            shares.append(cost / (window + cost))
    return shares


def image_net(task: str, images: TensorDataset) -> torch.nn.Module:
    """The image task's network: the small CNN (``fashion``), or 784-256-256-10 at 28x28 (``mlp``),
    little arithmetic per byte of parameters."""
    x = images.tensors[0]
    if task == "fashion":
        return small_cnn(x.shape[-1])
    nn = torch.nn
    return nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def charlm_task(config: dict[str, Any]) -> pl.LightningModule:
    """The example's CharGPT with its own data loader, and ``net`` (itself) for the model copies."""
    char_lm, train, _, vocab = charlm_data(config["charlm_blocks"])
    block, dim, layers, heads, batch_size, _, warmup, lr = CHARLM_SIZE

    class CharLMTask(char_lm.CharGPT):
        @property
        def net(self) -> torch.nn.Module:
            return self

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True)

    return CharLMTask(vocab, block, dim, layers, heads, lr, warmup)


def charlm_accuracy(config: dict[str, Any]) -> Any:
    """Next-character accuracy of a model copy on the held-out blocks."""
    char_lm, _, test, vocab = charlm_data(config["charlm_blocks"])
    block, dim, layers, heads, *_, warmup, lr = CHARLM_SIZE

    def evaluate(state: dict[str, torch.Tensor]) -> float:
        net = char_lm.CharGPT(vocab, block, dim, layers, heads, lr, warmup)
        net.load_state_dict(state)
        net.eval()
        x, y = test.tensors
        with torch.no_grad():
            correct = sum(int((net(xb).argmax(-1) == yb).sum()) for xb, yb in zip(x.split(64), y.split(64)))
        return correct / y.numel()

    return evaluate


def run_across_hosts(config: dict[str, Any], mbit_s: float, timeout: float) -> list[dict]:
    """The job's two ranks on two namespace hosts joined by a link limited to ``mbit_s`` (the rig of
    ``benchmarks/netrig.py``, deleted at the end); their reports, as :func:`run_job` returns them."""
    from benchmarks.netrig import Rig

    # one thread a rank, as Lightning gives each of the two ranks it launches on this machine's two cores
    # (cores // ranks per node); alone on its "node" a rank would take both, and the two would contend
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    logs = [Path(config["out"]).parent / f"rank{rank}.stderr" for rank in range(2)]  # files: a pipe could fill
    with Rig(hosts=2, rate_mbit=mbit_s) as rig, logs[0].open("w") as log0, logs[1].open("w") as log1:
        ranks = rig.launch_ranks([sys.executable, "-m", MODULE, "--worker", json.dumps(config)], RIG_PORT, env,
                                 stderr=[log0, log1], cwd=str(REPO), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        try:
            for rank in ranks:
                rank.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as late:
            raise JobFailed(f"{config['name']} on the real link did not finish within {timeout:.0f} s") from late
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
    for index, rank in enumerate(ranks):
        if rank.returncode != 0:
            error = logs[index].read_text(errors="replace")
            raise JobFailed(f"{config['name']} rank {index} on the real link failed (exit {rank.returncode}):\n{error[-3000:]}")
    return [json.loads((Path(config["out"]) / f"rank{rank}.json").read_text()) for rank in range(2)]


def run_configuration(task: str, name: str, mbit_s: float, seed: int, args: argparse.Namespace, evaluate: Any,
                      real: bool = False) -> dict[str, Any]:
    """One fit of ``name``: on the simulated link (``SlowLink``, both ranks on this machine's loopback), or
    with ``real`` across two namespace hosts joined by a link limited to ``mbit_s``."""
    with tempfile.TemporaryDirectory(prefix="elche-slow-link-") as folder:
        config = {
            "task": task, "name": name, "link_mbit_s": mbit_s, "latency_ms": args.latency_ms, "slowdown": args.slowdown,
            "seed": seed, "data": args.data, "train_samples": args.train_samples, "charlm_blocks": args.charlm_blocks,
            "eval_every_s": args.eval_every_s or EVAL_EVERY_S[task], "snapshots": str(Path(folder) / "snapshots.pt"),
            "out": str(Path(folder) / "reports"), "real_link": real,
        }  # fmt: skip
        if real:
            reports = run_across_hosts(config, mbit_s, args.timeout)
        else:
            reports = run_job(MODULE, worker, config, 2, args.timeout, warm=args.smoke)  # a smoke run forks
        points = torch.load(config["snapshots"])
    curve = [(round(p["seconds"], 2), p["samples"], evaluate(p["state"])) for p in points]  # every copy scored
    boundaries = reports[0]["boundaries"]
    sent = reports[0]["sent_bytes"]
    return {
        "curve": curve, "final_acc": curve[-1][2],
        "train_s": max(r["seconds"] for r in reports), "samples": sum(r["samples"] for r in reports),
        "boundaries": boundaries, "bytes_per_boundary": sent / boundaries if sent is not None and boundaries else None,
        "final_anchor": reports[0]["final_anchor"],
        # the first boundary carries the process group's warm-up (connections, buffers): left out
        "boundary_ms": statistics.fmean(reports[0]["boundary_ms"][1:]) if len(reports[0]["boundary_ms"]) > 1 else None,
        "overhead": settled(reports[0]["overheads"]),
    }


def settled(overheads: list[float]) -> Optional[float]:
    """The median overhead of the fit's second half, once the controller has sized the window."""
    late = overheads[len(overheads) // 2 :]
    return statistics.median(late) if late else None


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, Any]:
    # scoring runs between jobs, never during one; a smoke run shares the machine with other tests
    torch.set_num_threads(1 if args.smoke else 2)
    results: dict[str, Any] = {}
    goodput = {mbit_s: link_goodput(mbit_s, args.goodput_bytes) for mbit_s in args.links} if args.real_link else {}
    for task in args.tasks:
        if task in IMAGE_TASKS:
            test = load_data(args.data)[1]
            evaluate = functools.partial(accuracy, test=test, net=image_net(task, test))
        else:
            evaluate = charlm_accuracy(vars(args))
        target = {"fashion": args.fashion_target, "mlp": args.mlp_target, "charlm": args.charlm_target}[task]
        configs = SMOKE_TASK_CONFIGS.get(task, args.configs) if args.smoke and not args.real_link else args.configs
        for mbit_s in args.links:
            runs: dict[str, list[Optional[dict[str, Any]]]] = {name: [] for name in configs}
            real_runs: dict[str, list[Optional[dict[str, Any]]]] = {name: [] for name in configs}
            for repeat in range(args.repeats):
                for name in rotated(configs, repeat):
                    for real, kept in ((False, runs), (True, real_runs))[: 2 if args.real_link else 1]:
                        label = f"{task} {mbit_s:g} Mbit/s {name}{' real link' if real else ''}"
                        run = failures.attempt(
                            label, repeat, lambda: run_configuration(task, name, mbit_s, repeat, args, evaluate, real)
                        )
                        kept[name].append(run)
                        if run is not None:
                            print(f"{label} repeat {repeat + 1}: {run['train_s']:.1f} s, to target {to_target(run, target)} s, "
                                  f"final {run['final_acc']:.2%}, {run['bytes_per_boundary'] or 0:.0f} B/boundary, "
                                  f"{run['boundary_ms'] or 0:.1f} ms/boundary", flush=True)
            entry: dict[str, Any] = {"runs": runs, "target": target, "summary": summarize(runs, target)}
            if args.real_link:
                entry.update(real_runs=real_runs, goodput_mbit_s=goodput[mbit_s],
                             real_link=compare_links(runs, real_runs, mbit_s))
            results[f"{task} {mbit_s:g}"] = entry
    return results


def link_goodput(mbit_s: float, nbytes: int) -> float:
    """What one TCP transfer gets of the rig's link at ``mbit_s``, Mbit/s."""
    from benchmarks.netrig import Rig

    with Rig(hosts=2, rate_mbit=mbit_s) as rig:
        measured = rig.tcp_mbit_s(nbytes)
    print(f"real link at {mbit_s:g} Mbit/s: one TCP transfer of {nbytes / 1e6:g} MB ran at {measured:.1f} Mbit/s", flush=True)
    return measured


def error(simulated: Optional[float], real: Optional[float]) -> Optional[float]:
    """The simulation's relative error against the real link (+0.10: 10 % above it)."""
    return None if simulated is None or not real else simulated / real - 1.0


def compare_links(simulated: dict[str, list[Optional[dict[str, Any]]]], real: dict[str, list[Optional[dict[str, Any]]]],
                  mbit_s: float) -> dict[str, Any]:
    """Per configuration, paired within each repeat: training seconds and a boundary's cost on the real link,
    ``SlowLink``'s error against them, and the link model's (``cohort/link.py``, which ``SlowLink``, the
    controller and the simulator charge) against the link's part of a real boundary.

    That part is the real boundary less the configuration's local cost (pack, reduce on the loopback,
    unpack), taken from its simulated boundary less the model's time for the bytes sent (what
    ``SlowLink`` held it for, at zero latency)."""
    compared: dict[str, Any] = {}
    for name, real_repeats in real.items():
        rows = []
        for sim, actual in zip(simulated.get(name) or [], real_repeats):
            if not sim or not actual:
                continue
            row = {"real_train_s": actual["train_s"], "train_s_error": error(sim["train_s"], actual["train_s"]),
                   "real_boundary_ms": actual["boundary_ms"], "real_final_anchor": actual["final_anchor"],
                   "real_overhead": actual["overhead"], "boundary_ms_error": error(sim["boundary_ms"], actual["boundary_ms"]),
                   "model_link_ms": None, "real_link_ms": None, "model_error": None}  # fmt: skip
            sent = sim["bytes_per_boundary"]
            if sent and sim["boundary_ms"] is not None and actual["boundary_ms"] is not None:
                model = transfer_ms(sent, mbit_s, 0.0)
                real_link_ms = actual["boundary_ms"] - (sim["boundary_ms"] - model)  # less the local cost
                row.update(model_link_ms=model, real_link_ms=real_link_ms)
                row["model_error"] = error(model, real_link_ms) if real_link_ms > 0 else None  # lost in the noise
            rows.append(row)
        compared[name] = {
            key: spread(values) if (values := [row[key] for row in rows if row[key] is not None]) else None
            for key in ("real_train_s", "train_s_error", "real_boundary_ms", "boundary_ms_error", "model_link_ms",
                        "real_link_ms", "model_error", "real_final_anchor", "real_overhead")
        }  # fmt: skip
    return compared


def to_target(run: dict[str, Any], target: float) -> Optional[float]:
    """Training-clock seconds of the first model copy at ``target`` (None if none reached it)."""
    return next((seconds for seconds, _, acc in run["curve"] if acc >= target), None)


def reference_of(name: str) -> str:
    """The full-precision configuration ``name`` is compared with: the same policy and window, no
    compression nor fragments (``elche-int8-f4-h8`` -> ``elche-h8``); DDP against ElChe's default."""
    if name == "ddp":
        return "elche"
    return "-".join(part for part in name.split("-") if part not in ("bf16", "int8", "f4"))


def summarize(runs: dict[str, list[Optional[dict[str, Any]]]], target: float) -> dict[str, Any]:
    """Medians and spreads; speedups to target and accuracy differences paired (same repeat) with
    the full-precision configuration of the same policy and window (:func:`reference_of`)."""
    summary: dict[str, Any] = {}
    for name, repeats in runs.items():
        reference = runs.get(reference_of(name)) or []
        done = [dict(r, to_target_s=to_target(r, target)) for r in repeats if r]

        def of(key: str) -> Optional[dict[str, float]]:
            values = [r[key] for r in done if r.get(key) is not None]
            return spread(values) if values else None

        times = [(to_target(r, target) if r else None, to_target(ref, target) if ref else None) for r, ref in zip(repeats, reference)]
        speedups = [ref_s / own_s for own_s, ref_s in times if own_s and ref_s]
        gaps = [100 * (r["final_acc"] - ref["final_acc"]) for r, ref in zip(repeats, reference) if r and ref]
        summary[name] = {
            "to_target_s": of("to_target_s"), "final_acc": of("final_acc"), "train_s": of("train_s"),
            "bytes_per_boundary": of("bytes_per_boundary"), "final_anchor": of("final_anchor"),
            "speedup_to_target": spread(speedups) if speedups else None,
            "final_points_vs_elche": spread(gaps) if gaps else None,
        }
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| configuration | bytes per boundary | final anchor | training s | to target s "
        "| speedup to target vs full precision | final accuracy | vs full precision (points) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {cell(row['bytes_per_boundary'], '.3g')} | {cell(row['final_anchor'], '.0f')} | "
            f"{cell(row['train_s'], '.1f')} | {cell(row['to_target_s'], '.1f')} | {cell(row['speedup_to_target'], '.2f', unit='x')} | "
            f"{cell(row['final_acc'], '.2%')} | {cell(row['final_points_vs_elche'], '+.2f')} |"
        )
    return "\n".join(lines)


def bytes_table(results: dict[str, Any]) -> str:
    """Bytes per boundary and the final anchor of every configuration, per task and link."""
    keys = list(results)
    names = list(dict.fromkeys(name for key in keys for name in results[key]["summary"]))
    lines = ["| configuration | " + " | ".join(f"{key} Mbit/s: bytes per boundary, final anchor" for key in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name in names:
        cells = []
        for key in keys:
            row = results[key]["summary"].get(name)
            cells.append("-" if row is None else f"{cell(row['bytes_per_boundary'], '.3g')}, {cell(row['final_anchor'], '.0f')}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def real_link_table(entry: dict[str, Any], mbit_s: float) -> str:
    """The simulated link against the real one, per configuration (:func:`compare_links`)."""
    lines = [
        f"Real link: `tc tbf` at {mbit_s:g} Mbit/s between two namespace hosts; one TCP transfer ran at "
        f"{entry['goodput_mbit_s']:.1f} Mbit/s. Errors: simulated / real - 1.",
        "",
        "| configuration | training s, real link | SlowLink's error | ms a boundary, real link | SlowLink's error "
        "| link's ms a boundary: real, model | model's error | final anchor, real link "
        f"| overhead, real link (target {OVERHEAD_TARGET:.0%}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in entry["real_link"].items():
        lines.append(
            f"| {name} | {cell(row['real_train_s'], '.1f')} | {cell(row['train_s_error'], '+.0%')} | "
            f"{cell(row['real_boundary_ms'], '.1f')} | {cell(row['boundary_ms_error'], '+.0%')} | "
            f"{cell(row['real_link_ms'], '.1f')}, {cell(row['model_link_ms'], '.1f')} | {cell(row['model_error'], '+.0%')} | "
            f"{cell(row['real_final_anchor'], '.0f')} | {cell(row['real_overhead'], '.1%')} |"
        )
    return "\n".join(lines)


def tables(record: dict[str, Any]) -> dict[str, str]:
    results = record["results"]
    rendered = {"bytes": bytes_table(results)}
    for key, entry in results.items():
        task = key.split()[0]
        scored = "test accuracy" if task in IMAGE_TASKS else "next-character accuracy on held-out text"
        summary = summarize(entry["runs"], entry["target"])  # from the raw curves, at the recorded target
        rendered[f"{key} Mbit/s"] = f"Target: {entry['target']:.0%} {scored}.\n\n" + table(summary)
        if "real_link" in entry:
            rendered[f"{key} Mbit/s real link"] = real_link_table(entry, float(key.split()[1]))
    return rendered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--links", nargs="+", type=float, default=[100.0, 1000.0], help="link bandwidths, Mbit/s")
    parser.add_argument("--latency-ms", type=float, default=None,
                        help="the simulated link's latency (default 1; 0 with --real-link, whose rig adds none)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--slowdown", type=float, default=2.0, help="rank 1 is this many times slower")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--data", default="fashion", choices=["fashion", "digits"])
    parser.add_argument("--train-samples", type=int, default=None, help="Fashion-MNIST training images (all)")
    parser.add_argument("--charlm-blocks", type=int, default=None, help="char LM training blocks (the example's)")
    parser.add_argument("--fashion-target", type=float, default=0.84)
    parser.add_argument("--mlp-target", type=float, default=0.84)
    parser.add_argument("--charlm-target", type=float, default=0.35)
    parser.add_argument("--eval-every-s", type=float, default=None,
                        help="training-clock seconds between model copies "
                             "(default: 1 for fashion, 0.5 for mlp, 3 for charlm, whose scoring costs more)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--smoke", action="store_true", help="every configuration once on a few samples")
    parser.add_argument("--real-link", action="store_true",
                        help="also run each configuration across two namespace hosts joined by a real link of the "
                             "rate (root), and compare the simulated link with it")
    parser.add_argument("--goodput-bytes", type=int, default=25_000_000,
                        help="with --real-link: the TCP transfer that measures each link's goodput first")
    parser.add_argument("--json", type=Path, default=None, help="results file (default benchmarks/results/slow_link.json)")
    args = parser.parse_args()
    if args.real_link:
        from benchmarks.netrig import unavailable

        if (why := unavailable()) is not None:
            parser.error(f"--real-link runs on hosts made of network namespaces, which cannot be made here: {why}")
        if args.latency_ms:
            parser.error("--real-link compares at --latency-ms 0: the rig's link adds no latency (no netem here)")
    if args.latency_ms is None:
        args.latency_ms = 0.0 if args.real_link else 1.0
    if args.smoke:
        for key, value in (SMOKE_REAL_LINK if args.real_link else SMOKE).items():
            setattr(args, key, value)
        args.data = "digits"
    args.data = choose_data(args.data)
    args.json = results_path("slow_link", args)
    failures = Failures()
    results = measure(args, failures)
    conclude("slow_link", args, results, failures, tables)


if __name__ == "__main__":
    main_or_worker(main, worker)
