"""The torchft side of the peers benchmark: torchft's LocalSGD and DiLoCo, each in the plain PyTorch
loop torchft is written for, on the same model, data and batch as the Lightning configurations.

``run(config, timeout)`` starts torchft's lighthouse in the calling process and one replica group
of one process per rank (CPU, gloo), and returns each rank's report; rank 0 saves copies of the
model (``benchmarks.fashion.ModelCopies``) for scoring after the job, as the Lightning side does.

Why it is a fair peer: every replica builds the small CNN from the same seed and trains Adam on
its own equal share of each epoch's shuffled images (torchft's ``DistributedSampler``, one shard
per replica group, as torchft shards data), batch 64 per replica. ``sync_every`` counts inner
optimizer steps between synchronisations: LocalSGD averages the parameters, DiLoCo all-reduces the
pseudo-gradient (last global model minus local model) and steps an outer SGD with Nesterov
momentum on it, as in the DiLoCo paper and torchft's ``train_diloco.py``. A synchronisation costs
what it costs in torchft: a quorum round trip through the lighthouse, the all-reduce, and the
commit vote. A copy is taken only after a committed synchronisation, the only point where the
replicas hold one model; an epoch whose steps are not a multiple of ``sync_every`` ends with one
more synchronisation, so the final model is the cohort's and both replicas stop at the same step.

Set-up is off the clock, as ``init_process_group`` is for Lightning: one quorum before the first
batch connects the process group and lines the replicas up. Replicas start from identical weights,
so ``init_sync=False``: otherwise torchft's first quorum makes replica 1 fetch replica 0's state
over HTTP and throw away its first ``sync_every`` steps. A slower rank is slowed like Lightning's
``Slowdown`` (sleep before the optimizer step, the synchronisation left at full speed) or computes
its loss k times (``slowdown_model="arithmetic"``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.fashion import ModelCopies, load_data, repeated_loss, small_cnn, subset
from benchmarks.harness import run_ranks
from lightning_elche._jobs import main_or_worker, write_report
from lightning_elche.sim.slowdown import StepStretcher

MODULE = "benchmarks.peers_torchft"
# Collectives and commit votes are quick on one machine; a quorum waits for the slower replica's
# whole window of sync_every steps, so it gets longer.
TIMEOUT = timedelta(seconds=30)
QUORUM_TIMEOUT = timedelta(seconds=120)
# torchft's Rust side logs every quorum at INFO on stderr, where a failure's cause must stay visible.
RUST_LOG = "warn"


def slowdown(config: dict[str, Any], rank: int) -> float:
    k = float(config["factors"].get(str(rank), 1.0))
    if config["slowdown_model"] == "arithmetic" and k != int(k):
        raise ValueError(f"slowdown_model='arithmetic' repeats the loss k times: k must be an integer, got {k}")
    return k


def replica_manager(
    net: torch.nn.Module, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer, config: dict[str, Any]
) -> tuple[Any, Any]:
    """torchft's ``Manager`` of this rank's replica group (one process: its own store, as torchft's tests
    give each group), healing from a peer's model and both optimizers, every replica starting from the
    same weights (``init_sync=False``); and its store, which ends when the caller drops it."""
    from torchft import Manager, ProcessGroupGloo

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "inner_optim": inner.state_dict(), "outer_optim": outer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        outer.load_state_dict(state["outer_optim"])

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=config["ranks"], use_async_quorum=False,  # DiLoCo requires it; LocalSGD waits on its quorum at once anyway
        timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT, connect_timeout=TIMEOUT,
        rank=0, world_size=1, store_addr="localhost", store_port=store.port,
        lighthouse_addr=config["lighthouse"], replica_id=f"replica_{config['rank']}", init_sync=False,
    )  # fmt: skip
    return manager, store


def worker(config: dict[str, Any]) -> None:
    from torchft import DistributedSampler
    from torchft.local_sgd import DiLoCo, LocalSGD

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rank, ranks = config["rank"], config["ranks"]
    k = slowdown(config, rank)
    train = subset(load_data(config["data"])[0], config["train_samples"])
    torch.manual_seed(config["seed"])
    net = small_cnn(train.tensors[0].shape[-1])
    inner = torch.optim.Adam(net.parameters(), lr=config["lr"])
    outer = torch.optim.SGD(net.parameters(), lr=config["outer_lr"], momentum=config["outer_momentum"], nesterov=True)
    manager, store = replica_manager(net, inner, outer, config)  # the store serves the manager: hold it as long
    sampler = DistributedSampler(
        train, replica_rank=rank, num_replica_groups=ranks, group_rank=0, num_replicas=1, shuffle=True, seed=config["seed"]
    )
    loader = DataLoader(train, batch_size=config["batch_size"], sampler=sampler)
    algorithm = (
        DiLoCo(manager, [net], inner, outer, sync_every=config["sync_every"])
        if config["algorithm"] == "diloco" else LocalSGD(manager, net, inner, sync_every=config["sync_every"])
    )  # fmt: skip
    copies = ModelCopies(config["eval_every_s"], config["budget_s"])
    stretcher = StepStretcher()
    samples = steps = 0
    sync_s = 0.0
    manager.start_quorum()  # connect the process group and wait for every replica, off the clock
    with algorithm:
        started = time.perf_counter()
        for epoch in range(config["epochs"]):
            sampler.set_epoch(epoch)
            stretcher.restart()
            for x, y in loader:
                inner.zero_grad()
                repeated_loss(net, x, y, int(k) if config["slowdown_model"] == "arithmetic" else 1).backward()
                if config["slowdown_model"] == "sleep":
                    stretcher.stretch(k)
                committed = manager.current_step()
                stepped = time.perf_counter()
                inner.step()  # LocalSGD / DiLoCo synchronise in its post-hook every sync_every steps
                stretcher.restart()  # the synchronisation keeps its speed, as under Lightning's Slowdown
                samples += len(y)
                steps += 1
                if manager.current_step() != committed:
                    sync_s += time.perf_counter() - stepped
                    if rank == 0:
                        copies.offer(net, time.perf_counter() - started, samples * ranks)
        if steps % config["sync_every"]:  # the last, shorter window: same step count on every replica
            stepped = time.perf_counter()
            if isinstance(algorithm, LocalSGD):
                algorithm.sync()
            else:  # DiLoCo has no public sync(): this is what its post-hook does at a window's end
                manager.start_quorum()
                algorithm._fragments[0].prepare_sync()
                algorithm._fragments[0].perform_sync()
            sync_s += time.perf_counter() - stepped
        seconds = time.perf_counter() - started
    if rank == 0:
        copies.finish(net, seconds, samples * ranks, config["snapshots"])
    manager.start_quorum(allow_heal=False)  # no replica leaves while the other may still use the process group
    manager.shutdown(wait=False)
    write_report(config["out"], rank, {
        "seconds": seconds, "samples": samples, "steps": steps, "syncs": manager.current_step(), "sync_s": sync_s,
    })  # fmt: skip


def run(config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run one torchft configuration; per-rank reports: ``seconds`` (training clock), ``samples``,
    ``steps`` (optimizer steps), ``syncs`` (committed synchronisations) and ``sync_s`` (wall seconds
    in the steps that synchronised: quorum, all-reduce, commit and waiting for the slower replica)."""
    if config["algorithm"] not in ("localsgd", "diloco") or config["slowdown_model"] not in ("sleep", "arithmetic"):
        raise ValueError(f"unknown algorithm {config['algorithm']!r} or slowdown_model {config['slowdown_model']!r}")
    for rank in range(config["ranks"]):
        slowdown(config, rank)
    os.environ.setdefault("RUST_LOG", RUST_LOG)  # read once, when torchft is first imported
    from torchft.coordination import LighthouseServer

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    name = f"torchft-{config['algorithm']}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", RUST_LOG=os.environ["RUST_LOG"])
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=config["ranks"])
    try:
        configs = [dict(config, rank=rank, lighthouse=lighthouse.address()) for rank in range(config["ranks"])]
        return run_ranks(MODULE, name, configs, out, env, timeout)
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    main_or_worker(lambda: None, worker)
