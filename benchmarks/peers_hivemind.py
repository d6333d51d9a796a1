"""The Hivemind side of the peers benchmark: ``hivemind.Optimizer`` (Hivemind 1.1.12) in the plain
PyTorch loop Hivemind is written for, on the same model, data and batch as the other configurations.

``run(config, timeout)`` starts one process per rank, each with its own DHT node on 127.0.0.1
(rank 0's node is the others' initial peer; its addresses pass through a file in ``config["out"]``)
and its own ``hivemind.Optimizer``, and returns each rank's report. Hivemind's ``p2pd`` daemon comes
inside the manylinux wheel (``hivemind/hivemind_cli/p2pd``), so nothing is downloaded at run time;
building Hivemind from its sdist is another matter: its ``setup.py`` downloads ``p2pd`` from GitHub.

What runs: every rank builds the small CNN from the same seed and trains Adam, batch 64, reporting
each batch to the Optimizer. Hivemind counts samples across the swarm, not steps: an Optimizer
"epoch" is ``hivemind_target_batch_size`` samples of the whole swarm (default ``ranks * batch_size
* sync_every`` = 2,048, the fixed-period peers' window), after which the peers average in a round.
With ``hivemind_local_updates=True`` (default; the local-SGD analogue) every rank steps Adam locally
each batch and the round averages the parameters (delta rule: steps taken during the round are
kept); with ``False`` the ranks accumulate gradients, all-reduce them and step once per
``target_batch_size`` samples (large-batch synchronous training). A rank that falls a whole epoch
behind downloads the others' state ("Peer is out of sync"): counted as ``state_loads``.

Data (``hivemind_data``). ``"shared"`` (default): the peers take their batches from one queue of the
epoch's samples (:class:`SharedQueue`: a counter in a file under ``flock``, one permutation per epoch
from the seed) until it is empty, so a faster peer takes more batches, the cohort trains exactly the
epoch's samples, each once, and both peers stop within a step of each other. This is the mode in
which Hivemind's adaptation to speed can work: a target batch is filled by whoever is fast, as in a
swarm reading a large dataset. Exact once-per-sample coverage is more than Hivemind itself offers
(its users give each peer its own shuffle); the queue is the benchmark's, so that Hivemind trains
the same samples as every other configuration and throughput and accuracy compare at equal samples.
``"halves"``: fixed equal halves (``DistributedSampler``), as the fixed-period peers; the fast peer
then finishes first, says goodbye, and the slow one trains the rest of its half alone (at k = 4
most of the run), so the mode measures the equal split, not Hivemind (measured: 486 samples/s,
0.28 of the solo rates' sum; shared: 0.77).

Settings, for two peers on one host (``DEFAULTS``): ``target_group_size = ranks`` (a round's group
is complete, and all-reduce starts, as soon as every peer has joined, instead of waiting out the
matchmaking time); ``matchmaking_time`` 1 s, now only an upper bound (a round with both peers forms
in tens of milliseconds); ``request_timeout`` 0.5 s (below it, as Hivemind requires);
``averaging_timeout`` 5 s; the progress tracker refreshes the swarm's progress every 0.1-1 s
(``min/max/default_refresh_period``; Hivemind's 0.5-10 s let the slow peer notice an epoch late, or
fall behind and download state) and ``delay_state_averaging=True`` (the round runs in the
background; with local updates the next ``opt.step`` still waits for it). ``hivemind_preschedule``:
Hivemind starts a round's matchmaking ahead of the epoch's estimated end only once it has timed an
earlier pre-scheduled round, which for state averaging never happens in 1.1.12 (the timing is only
taken for a pre-scheduled round), so the estimate is seeded with zero: rounds then block about half
as long (measured median 0.19 s against 0.40 s on the fast peer).

Where the time goes (Fashion-MNIST epoch, k = 4, sleep slowdown, on this 2-core machine under other
load): 28 rounds of 2,048 samples, none failed, no state download; a round blocks the fast peer
about 0.19 s (``blocked_s`` 4.7 s of 58 s), the slow one 0.14 s; Hivemind's processes (two DHT
nodes, two averagers, two ``p2pd``) use about 0.45 of a core throughout (progress is published to the
DHT at every step and fetched every refresh), which on two cores is taken from training. The
cohort trained 1,034 samples/s, 0.77 of the two solo rates' sum measured just before (1,337), to a
final accuracy of 85.9 % (84 % at 25 s); the machine's load varied too much between the solo and
the Hivemind job for the ratio to be better than +-0.2 (a second repeat read 1.12).

The final model: a rank that runs out of batches applies a round already finished (one in flight
is not waited for), saves its parameters and says goodbye to the tracker, so the others stop
counting on it; rank 0 then averages every rank's final parameters (one equal-weight average, as
Hivemind's own rounds weigh peers), at the training clock of the last rank to finish. Rank 0's
copies (``benchmarks.fashion.ModelCopies``) are taken right after each averaging round is applied
on rank 0; their ``samples`` is the cohort's count so far (the queue's; with halves, rank 0's count
times ``ranks``), the final copy's the exact total.

Set-up (DHT, p2pd, the Optimizer's first state exchange) is off the clock; a file barrier lines the
ranks up before the first batch, and after its first step each rank waits until its progress tracker
counts every rank in the swarm (a peer is counted once it has reported samples). Without that wait,
a fast rank whose tracker had not yet seen a slow rank's first step (k = 40 under a loaded CI run)
moved through its first epochs alone; the slow rank then joined epochs behind, downloaded the state,
and from there on the two reached each round in different epochs: every round failed with "could
not find a group" (1 of 6 runs under a concurrent test job, all rounds of a 41 s run).

A slower rank is slowed like Lightning's ``Slowdown`` (sleep before the optimizer step, averaging
and matchmaking left at full speed) or computes its loss k times (``slowdown_model="arithmetic"``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from benchmarks.fashion import ModelCopies, load_data, repeated_loss, small_cnn, subset
from benchmarks.harness import run_ranks
from lightning_elche._jobs import main_or_worker, write_report
from lightning_elche.sim.slowdown import StepStretcher

MODULE = "benchmarks.peers_hivemind"
HOST = "/ip4/127.0.0.1/tcp/0"
SETUP_TIMEOUT_S = 120.0
DEFAULTS: dict[str, Any] = {
    "sync_every": 16,  # default target_batch_size = ranks * batch_size * sync_every
    "hivemind_data": "shared",  # "shared": one queue of the epoch's samples; "halves": fixed equal shares
    "hivemind_target_batch_size": None,
    "hivemind_local_updates": True,
    "hivemind_matchmaking_time": 1.0,
    "hivemind_request_timeout": 0.5,
    "hivemind_averaging_timeout": 5.0,
    "hivemind_target_group_size": None,  # default: ranks, the whole swarm
    "hivemind_min_refresh_period": 0.1,
    "hivemind_max_refresh_period": 1.0,
    "hivemind_default_refresh_period": 0.5,
    "hivemind_preschedule": True,
    "hivemind_delay_state_averaging": True,
    "hivemind_run_id": "elche-peers",
}


def settings(config: dict[str, Any]) -> dict[str, Any]:
    config = {**DEFAULTS, **config}
    if config["hivemind_target_batch_size"] is None:
        config["hivemind_target_batch_size"] = config["ranks"] * config["batch_size"] * config["sync_every"]
    if config["hivemind_target_group_size"] is None:
        config["hivemind_target_group_size"] = config["ranks"]
    if config["hivemind_data"] not in ("shared", "halves"):
        raise ValueError(f"hivemind_data must be 'shared' or 'halves', got {config['hivemind_data']!r}")
    return config


def slowdown(config: dict[str, Any], rank: int) -> float:
    k = float(config["factors"].get(str(rank), 1.0))
    if config["slowdown_model"] == "arithmetic" and k != int(k):
        raise ValueError(f"slowdown_model='arithmetic' repeats the loss k times: k must be an integer, got {k}")
    return k


class Rounds(logging.Handler):
    """Hivemind's averaging rounds, read from its own status lines (``verbose=True``): Hivemind runs
    them in background threads and exposes no counter. ``synced`` counts rounds with at least two
    peers whose result this rank has applied, ``failed`` rounds that found no group or broke off;
    ``durations`` their wall seconds from the epoch transition that started them (gradients: from
    "Beginning optimizer step") to their end."""

    AVERAGED = re.compile(r"^Averaged (parameters|gradients) with (\d+) peers")

    def __init__(self, gradients: bool) -> None:
        super().__init__(logging.INFO)
        self.gradients = gradients
        self.synced = self.state_loads = self.failed = 0
        self.durations: list[float] = []
        self._began = None
        self._averaged = False

    def emit(self, record: logging.LogRecord) -> None:
        msg, now = record.getMessage(), time.perf_counter()
        if msg.startswith("Beginning optimizer step" if self.gradients else "Transitioning to epoch"):
            self._began = now
        elif m := self.AVERAGED.match(msg):
            if (m.group(1) == "gradients") == self.gradients and int(m.group(2)) >= 2:
                if self._began is not None:
                    self.durations.append(now - self._began)
                if self.gradients:
                    self.synced += 1  # the optimizer step on the averaged gradients follows at once
                else:
                    self._averaged = True
        elif msg.startswith("Received parameters from background averaging round") and self._averaged:
            self._averaged = False
            self.synced += 1
        elif msg.startswith(("Averaging failed", "Averaging gradients failed")):
            self.failed += 1
        elif msg.startswith("Peer is out of sync"):
            self.state_loads += 1


class SharedQueue:
    """The epochs' samples as one queue that every rank takes its next batch from: a counter of the
    samples handed out so far, in a file under ``fcntl.flock`` (a few microseconds a batch). Every
    rank draws the same permutation of each epoch from the seed, so the samples a rank claims,
    ``[start, start + count)`` of it, are seen once by the cohort, and a faster rank simply takes
    more batches."""

    def __init__(self, path: Path, size: int, epochs: int, seed: int) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.size, self.total, self.seed = size, size * epochs, seed
        self._perms: dict[int, torch.Tensor] = {}

    @staticmethod
    def create(path: Path) -> None:
        path.write_bytes((0).to_bytes(8, "little"))

    def claimed(self) -> int:
        """Samples handed out so far, to every rank."""
        return int.from_bytes(os.pread(self.fd, 8, 0), "little")

    def claim(self, n: int) -> torch.Tensor:
        """The indices of this rank's next batch: up to ``n``, none once the epochs are handed out."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            start = self.claimed()
            epoch, offset = divmod(start, self.size)
            count = max(0, min(n, self.total - start, self.size - offset))  # a batch stays within an epoch
            os.pwrite(self.fd, (start + count).to_bytes(8, "little"), 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))}
        return self._perms[epoch][offset : offset + count]


def wait_until(ready: Callable[[], bool], timed_out: Callable[[], str], timeout: float, poll_s: float) -> None:
    """Poll ``ready`` every ``poll_s`` until it holds; past ``timeout``, a TimeoutError saying ``timed_out()``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(timed_out())
        time.sleep(poll_s)


def wait_for(paths: list[Path], what: str, timeout: float = SETUP_TIMEOUT_S) -> None:
    def missing() -> list[str]:
        return [str(p) for p in paths if not p.exists()]

    wait_until(lambda: not missing(), lambda: f"{what}: still missing after {timeout:.0f} s: {missing()}", timeout, 0.05)


def wait_for_swarm(tracker: Any, ranks: int, timeout: float = SETUP_TIMEOUT_S) -> None:
    """Until the progress tracker counts ``ranks`` peers (each counts once it has reported samples)."""
    def counted() -> int:
        return tracker.global_progress.num_peers

    def timed_out() -> str:
        return f"after its first step, this rank's tracker counts {counted()} of {ranks} peers after {timeout:.0f} s"

    wait_until(lambda: counted() >= ranks, timed_out, timeout, 0.01)


def save_atomically(obj: Any, path: Path) -> None:
    torch.save(obj, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def batches(
    config: dict[str, Any], train: TensorDataset, rank: int, queue: Optional[SharedQueue]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: from the shared queue until the cohort has taken the epochs' samples, or
    its own equal half of each epoch (``DistributedSampler``)."""
    x, y = train.tensors
    if queue is not None:
        while len(idx := queue.claim(config["batch_size"])):
            yield x[idx], y[idx]
        return
    sampler = DistributedSampler(train, num_replicas=config["ranks"], rank=rank, shuffle=True, seed=config["seed"])
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        for idx in BatchSampler(sampler, config["batch_size"], drop_last=False):
            yield x[idx], y[idx]


def worker(config: dict[str, Any]) -> None:
    import hivemind

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    config = settings(config)
    rank, ranks, out = config["rank"], config["ranks"], Path(config["out"])
    k = slowdown(config, rank)
    gradients = not config["hivemind_local_updates"]
    rounds = Rounds(gradients)
    hm_log = logging.getLogger("hivemind")
    for handler in hm_log.handlers:  # keep stderr readable: drop the progress line logged at every refresh
        handler.addFilter(lambda r: " accumulated " not in r.getMessage())
    hm_log.addHandler(rounds)

    train = subset(load_data(config["data"])[0], config["train_samples"])
    total = len(train) * config["epochs"]
    torch.manual_seed(config["seed"])
    net = small_cnn(train.tensors[0].shape[-1])
    maddrs = out / "dht.json"
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=[HOST])
        (out / "dht.tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(out / "dht.tmp", maddrs)
    else:
        wait_for([maddrs], "rank 0's DHT addresses")
        dht = hivemind.DHT(start=True, host_maddrs=[HOST], initial_peers=json.loads(maddrs.read_text()))
    target = config["hivemind_target_batch_size"]
    opt = hivemind.Optimizer(
        dht=dht, run_id=config["hivemind_run_id"], target_batch_size=target, batch_size_per_step=config["batch_size"],
        optimizer=torch.optim.Adam(net.parameters(), lr=config["lr"]), use_local_updates=not gradients,
        matchmaking_time=config["hivemind_matchmaking_time"], averaging_timeout=config["hivemind_averaging_timeout"],
        delay_state_averaging=config["hivemind_delay_state_averaging"],
        averager_opts={"request_timeout": config["hivemind_request_timeout"], "target_group_size": config["hivemind_target_group_size"]},
        tracker_opts={key: config[f"hivemind_{key}"] for key in ("min_refresh_period", "max_refresh_period", "default_refresh_period")},
        verbose=True,
    )  # fmt: skip
    if config["hivemind_preschedule"]:
        # Hivemind pre-schedules a round's matchmaking (so it overlaps the last steps of the epoch)
        # only once it has timed one pre-scheduled round; for state averaging that never happens
        # (1.1.12 times it only for a pre-scheduled round): seed the estimate with "no delay".
        opt.delay_before_state_averaging.update(task_size=1, interval=0.0)
    (out / f"ready{rank}").touch()
    wait_for([out / f"ready{r}" for r in range(ranks)], "the other ranks' Optimizers")

    shared = config["hivemind_data"] == "shared"
    queue = SharedQueue(out / "queue", len(train), config["epochs"], config["seed"]) if shared else None
    repeats = int(k) if config["slowdown_model"] == "arithmetic" else 1
    copies = ModelCopies(config["eval_every_s"], config["budget_s"])
    stretcher = StepStretcher()
    samples = steps = seen = 0
    step_times: list[float] = []
    started, unix_started = time.perf_counter(), time.time()
    stretcher.restart()
    for x, y in batches(config, train, rank, queue):
        opt.zero_grad()
        repeated_loss(net, x, y, repeats).backward()
        if config["slowdown_model"] == "sleep":
            stretcher.stretch(k)
        stepped = time.perf_counter()
        opt.step(batch_size=len(y))  # reports progress; steps locally, averages or loads state as Hivemind decides
        step_times.append(time.perf_counter() - stepped)
        stretcher.restart()  # averaging and matchmaking keep their speed, as under Lightning's Slowdown
        samples += len(y)
        steps += 1
        if steps == 1:
            wait_for_swarm(opt.tracker, ranks)
        if rounds.synced != seen:
            seen = rounds.synced
            if rank == 0:
                cohort = queue.claimed() if queue is not None else min(samples * ranks, total)
                copies.offer(net, time.perf_counter() - started, cohort)
    opt.state_averager.step(apply_delayed_updates=True)  # apply a round already finished; one in flight is not waited for
    save_atomically({"state": net.state_dict(), "samples": samples}, out / f"final{rank}.pt")
    opt.tracker.shutdown(opt.shutdown_timeout)  # goodbye: the others stop counting on this rank
    seconds = time.perf_counter() - started
    synced, epochs = rounds.synced, opt.local_epoch
    if rank == 0:  # the cohort's final model: the equal-weight average of every rank's last parameters
        wait_for([out / f"final{r}.pt" for r in range(ranks)], "the other ranks' final parameters", timeout=float("inf"))
        finals = [torch.load(out / f"final{r}.pt") for r in range(ranks)]
        net.load_state_dict({name: sum(f["state"][name] for f in finals) / ranks for name in finals[0]["state"]})
        seconds = time.perf_counter() - started
        copies.finish(net, seconds, sum(f["samples"] for f in finals), config["snapshots"])
    opt.shutdown()
    dht.shutdown()
    typical = statistics.median(step_times) if step_times else 0.0
    write_report(str(out), rank, {
        "seconds": seconds, "samples": samples, "steps": steps, "syncs": synced, "failed_rounds": rounds.failed,
        "epochs": epochs, "state_loads": rounds.state_loads, "step_s": sum(step_times),
        "blocked_s": sum(max(0.0, t - typical) for t in step_times), "round_s": rounds.durations,
        "clock": [unix_started, unix_started + seconds], "target_batch_size": target,
    })  # fmt: skip


def run(config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run one Hivemind configuration; per-rank reports: ``seconds`` (training clock; rank 0's ends
    when the last rank's parameters are averaged in), ``samples``, ``steps`` (optimizer steps),
    ``syncs`` (averaging rounds of at least two peers applied on this rank), ``failed_rounds``,
    ``epochs`` (Hivemind's epoch at the end), ``state_loads`` (times this rank fell behind and
    downloaded the swarm's state), ``step_s`` (wall seconds inside ``opt.step()``), ``blocked_s``
    (of which beyond the median step: waiting for rounds, state downloads), ``round_s`` (each
    round's wall seconds), ``clock`` (the training clock's start and end, Unix time) and
    ``target_batch_size``. Config keys beyond the driver's: ``DEFAULTS``.

    The ranks run under ``sys.executable``: Hivemind must be installed in the running interpreter's
    environment (``pip install hivemind==1.1.12``, the manylinux wheel, which ships ``p2pd``)."""
    if config["slowdown_model"] not in ("sleep", "arithmetic"):
        raise ValueError(f"unknown slowdown_model {config['slowdown_model']!r}")
    for rank in range(config["ranks"]):
        slowdown(config, rank)
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("ready*"), *out.glob("final*.pt"), out / "dht.json"]:
        stale.unlink(missing_ok=True)  # an address or a barrier is this run's or none (run_ranks clears the reports)
    SharedQueue.create(out / "queue")
    name = "hivemind" + ("" if config.get("hivemind_local_updates", True) else "-gradients")
    # ELCHE_HIVEMIND_JOB marks every process of the job, p2pd included (it inherits the environment).
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="INFO", ELCHE_HIVEMIND_JOB=str(out))
    configs = [dict(config, rank=rank) for rank in range(config["ranks"])]
    return run_ranks(MODULE, name, configs, out, env, timeout, end_leftovers=kill_session)


def kill_session(sid: int) -> None:
    """End the DHT's and averagers' processes and p2pd that a rank in session ``sid`` left over."""
    for pid in session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_members(sid: int) -> list[int]:
    """Processes in session ``sid`` (a rank started with ``start_new_session`` leads its own)."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[3]) == sid:  # after the name: state ppid pgrp session
            members.append(int(entry.name))
    return members


if __name__ == "__main__":
    main_or_worker(lambda: None, worker)
