"""torchft's DiLoCo on the time-to-accuracy benchmark's tasks, in the plain PyTorch loop torchft is
written for: ``benchmarks/peers_torchft.py``'s set-up (its lighthouse in the driver, one replica group
of one process per rank, gloo, equal shards from torchft's ``DistributedSampler``, ``init_sync=False``
since every replica starts from the same weights, a quorum before the clock starts), generalised to
a task's network, loss, optimizer, per-step schedule and gradient clipping, over several epochs.

A copy for evaluation is offered after each committed synchronisation, the only point where the
replicas hold one model; the inner steps of a run that are not a multiple of ``sync_every`` end with
one more synchronisation, so the final model is the cohort's.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.harness import run_ranks
from benchmarks.peers_torchft import RUST_LOG, replica_manager
from benchmarks.tta_copies import SampleCopies
from benchmarks.tta_tasks import TASKS
from lightning_elche._jobs import write_report
from lightning_elche.sim.slowdown import StepStretcher


def diloco_worker(config: dict[str, Any]) -> None:
    from torchft import DistributedSampler
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rank, ranks = config["rank"], config["ranks"]
    k = config["k"] if rank == 1 else 1.0
    task = TASKS[config["task"]]
    train = task.train_set(config)
    net = task.network(config)
    per_replica_steps = math.ceil(math.ceil(len(train) / ranks) / task.batch_size) * config["epochs"]
    inner, schedule = task.optimizers(net, per_replica_steps)  # a replica's steps are the DDP-equivalent steps
    outer = torch.optim.SGD(net.parameters(), lr=config["outer_lr"], momentum=config["outer_momentum"], nesterov=True)
    manager, store = replica_manager(net, inner, outer, config)  # the store serves the manager: hold it as long
    sampler = DistributedSampler(
        train, replica_rank=rank, num_replica_groups=ranks, group_rank=0, num_replicas=1, shuffle=True, seed=config["seed"]
    )
    loader = DataLoader(train, batch_size=task.batch_size, sampler=sampler)
    diloco = DiLoCo(manager, [net], inner, outer, sync_every=config["sync_every"])
    copies = SampleCopies(config["every_samples"])
    stretcher = StepStretcher()
    samples = steps = 0
    manager.start_quorum()  # connect the process group and wait for every replica, off the clock
    with diloco:
        started = time.perf_counter()
        for epoch in range(config["epochs"]):
            sampler.set_epoch(epoch)
            stretcher.restart()
            for batch in loader:
                inner.zero_grad()
                task.loss(net, batch).backward()
                if task.clip is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), task.clip)
                stretcher.stretch(k)
                committed = manager.current_step()
                inner.step()  # DiLoCo synchronises in its post-hook every sync_every steps
                stretcher.restart()  # the synchronisation keeps its speed, as under Lightning's Slowdown
                if schedule is not None:
                    schedule.step()
                samples += len(batch[0])
                steps += 1
                if manager.current_step() != committed and rank == 0:
                    copies.offer(net, time.perf_counter() - started, samples * ranks)
        if steps % config["sync_every"]:  # the last, shorter window: DiLoCo has no public sync(), this is its post-hook's
            manager.start_quorum()
            diloco._fragments[0].prepare_sync()
            diloco._fragments[0].perform_sync()
        seconds = time.perf_counter() - started
    if rank == 0:
        copies.finish(net, seconds, samples * ranks, Path(config["snapshots"]) / "rank0.pt")
    manager.start_quorum(allow_heal=False)  # no replica leaves while the other may still use the process group
    manager.shutdown(wait=False)
    write_report(config["out"], rank, {"seconds": seconds, "samples": samples, "boundaries": manager.current_step()})


def run_diloco(module: str, config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """The job: torchft's lighthouse here, ``python -m module --worker`` per replica; each rank's report."""
    os.environ.setdefault("RUST_LOG", RUST_LOG)  # read once, when torchft is first imported
    from torchft.coordination import LighthouseServer

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", RUST_LOG=os.environ["RUST_LOG"])
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=config["ranks"])
    try:
        configs = [dict(config, rank=rank, lighthouse=lighthouse.address()) for rank in range(config["ranks"])]
        return run_ranks(module, "torchft-diloco", configs, out, env, timeout)
    finally:
        lighthouse.shutdown()
