"""Launch an elastic ElChe fit: ranks that die leave the cohort, the others train on, new ranks join.

    python -m lightning_elche.launch --nproc-per-node 3 train.py --my-args      # one machine, 3 ranks
    python -m lightning_elche.launch --nproc-per-node 3 --replace train.py      # a rank that dies is replaced
    python -m lightning_elche.launch --nproc-per-node 3 --replace --spares 1 train.py  # ... by a spare started ahead
    python -m lightning_elche.launch --nproc-per-node 2 --join --rdzv-endpoint HOST:PORT train.py  # 2 more join

The flags that torchrun also has mean what they mean there (``--nproc-per-node``, ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``), so a torchrun command line changes in its first word only;
everything after the script is the script's, untouched. SIGTERM, SIGINT and SIGUSR1 sent to the
launcher are forwarded to every rank, as torchrun's agent does, so a preempted job stops at the next
boundary with its checkpoint; the launcher then waits up to ``--signal-grace`` seconds for the ranks.

Why not torchrun or Lightning's launcher: both end every rank when one fails (Lightning's process
observer kills the siblings; torchrun's agent stops the whole worker group and restarts it from the
script's start), which is what an elastic cohort must not do. This launcher hosts the rendezvous
store in its own process, so that no rank's death takes it down, and gives each rank the environment
torchrun would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``..., ``TORCHELASTIC_USE_AGENT_STORE=True``):
Lightning then takes the processes as launched externally, and ``ElCheStrategy(elastic=True)`` finds
the store and its member id (``ELCHE_MEMBER_ID``). See docs/elastic.md.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_elche.comm.rendezvous import (
    LAUNCHER_STORE_ANSWER_S,
    attach_launcher,
    cohort_gone,
    detach_launcher,
    end_waiting,
    host_store,
    launcher_store,
    launchers_attached,
    next_member_id,
    ranks_trained,
    record_exit,
    reserve_member_ids,
    was_admitted,
)
from lightning_elche.comm.store import BoundedStore, StoreUnreachable
from lightning_elche.lightning.warm_start import (
    COLD_START_VARIABLE,
    WarmStarter,
    WorkerProcess,
    ZygoteUnusable,
    import_zygote,
)

POLL_S = 0.1
COHORT_CHECK_S = 1.0  # how often, after a failure, the store is read for whether any member is left
SPARES_HELD_AT_MOST_S = 30.0  # a spare starts after this even if a rank on its way in never trains
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # torchrun's agent forwards these too


@dataclass
class Worker:
    member: int
    slot: int  # the local rank: which device of this machine it uses
    process: WorkerProcess
    joined: bool
    spare: bool = False


@dataclass
class Launch:
    """The workers one launcher started on this machine, and what became of them."""

    arguments: argparse.Namespace
    environment: dict[str, str]
    store: BoundedStore
    workers: list[Worker] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)  # member id -> exit code
    replaced: int = 0
    finished_at: Optional[float] = None  # when the first member finished the fit, or the last one failed
    failed: bool = False  # every member of the cohort exited with an error: the fit cannot go on
    cohort_checked_at: float = -math.inf
    held_spares: list[tuple[int, float, int]] = field(default_factory=list)  # (local rank, since, ranks trained first)
    warm: Optional[WarmStarter] = None  # forks workers from pre-imported torch and Lightning (else: fresh interpreters)
    stopping: bool = False  # a SIGTERM or SIGINT was forwarded: the ranks are stopping, none is replaced
    stopped_by: Optional[int] = None  # that signal
    stopping_since: Optional[float] = None

    def start(self, member: int, slot: int, joining: bool, spare: bool = False) -> None:
        env = {
            **self.environment,
            "RANK": str(member),
            "LOCAL_RANK": str(slot),
            "ELCHE_MEMBER_ID": str(member),
            "ELCHE_JOIN": "1" if joining else "0",
            "ELCHE_SPARE": "1" if spare else "0",
        }
        script, args = self.arguments.script, self.arguments.script_args
        self.workers.append(Worker(member, slot, self._process(script, args, env), joining, spare))

    def _process(self, script: str, args: list[str], env: dict[str, str]) -> WorkerProcess:
        if self.warm is not None:
            try:
                return self.warm.start(script, args, env)
            except ZygoteUnusable as unusable:
                print(f"lightning_elche.launch: starting ranks as new interpreters: {unusable}", file=sys.stderr, flush=True)
                self.warm = None
        return subprocess.Popen([sys.executable, "-u", script, *args], env=env)

    def watch(self) -> int:
        """Wait for every worker; replace the ones that fail when asked to. The launch succeeds when
        some worker finished the fit and every failure was one the cohort survived (a replaced rank,
        or a rank the others went on without)."""
        while True:
            running, watched = [], len(self.workers)
            for worker in self.workers[:watched]:
                code = worker.process.poll()
                if code is None:
                    running.append(worker)
                    continue
                if code == 0 and worker.spare and not was_admitted(self.store, worker.member):
                    continue  # a spare that was not needed: it did not finish the fit (which may have failed)
                self.exit_codes[worker.member] = code
                if code != 0:
                    record_exit(self.store, worker.member, code, self.environment["ELCHE_LAUNCHER"], worker.slot)
                    self.cohort_checked_at = -math.inf  # was it the last member? (other launchers' exits: each second)
                if code != 0 and not self.stopping and self.replaced < self.arguments.max_replacements and not self._over():
                    self.replaced += 1
                    self._replace(worker, code)
            self.workers = running + self.workers[watched:]  # and the replacements started meanwhile
            if not self.workers:
                if self.stopped_by is not None:  # as a shell reports a process the signal ended
                    return 128 + self.stopped_by
                return 0 if 0 in self.exit_codes.values() else next(iter(self.exit_codes.values()), 1)
            if self.stopping:
                self._kill_after_signal_grace()
            elif self._over():
                self._end_stragglers()
            else:
                self.start_held_spares()
            time.sleep(POLL_S)  # the launcher's own pace of polling its children, not a wait for a condition

    def _kill_after_signal_grace(self) -> None:
        """Ranks still running ``--signal-grace`` seconds after a forwarded SIGTERM or SIGINT are killed, as
        torchrun's agent kills its workers after its own grace."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        elif time.monotonic() - self.stopping_since > self.arguments.signal_grace:
            for worker in self.workers:
                print(f"lightning_elche.launch: member {worker.member} still running {self.arguments.signal_grace:g} s "
                      "after the signal; killed", file=sys.stderr, flush=True)
                worker.process.kill()

    def _replace(self, worker: Worker, code: int) -> None:
        """A joiner in the failed worker's place; or, with spares, a waiting spare takes it, and a new spare
        is held until that one has trained. A spare that failed (waiting, or as it was admitted) trains no
        more: the new one starts at once."""
        message = f"lightning_elche.launch: member {worker.member} exited with {code}; "
        if self.arguments.spares:
            print(message + "a spare takes its place", file=sys.stderr, flush=True)
            self.hold_spare(worker.slot, ranks_first=0 if worker.spare else 1)  # 1: the spare that takes the place
            return
        member = next_member_id(self.store)
        print(message + f"member {member} replaces it on local rank {worker.slot}", file=sys.stderr, flush=True)
        self.start(member, worker.slot, joining=True)

    def hold_spare(self, slot: int, ranks_first: int) -> None:
        """A spare for ``slot``, to start once ``ranks_first`` more ranks have trained a batch."""
        self.held_spares.append((slot, time.monotonic(), ranks_trained(self.store) + ranks_first))

    def start_held_spares(self) -> None:
        """Spares start once the ranks on their way in have trained a batch (or after ``SPARES_HELD_AT_MOST_S``):
        their start-up then does not slow the members' own, or a newcomer's."""
        if not self.held_spares:
            return
        trained, now = ranks_trained(self.store), time.monotonic()
        for held in list(self.held_spares):
            slot, since, needed = held
            if trained >= needed or now - since >= SPARES_HELD_AT_MOST_S:
                self.held_spares.remove(held)  # idle on a member's device until a place (and its device) is free
                member = next_member_id(self.store)
                print(f"lightning_elche.launch: spare member {member} starts on local rank {slot}", file=sys.stderr, flush=True)
                self.start(member, slot, joining=True, spare=True)

    def _end_stragglers(self) -> None:
        """The fit is over: a rank still running after the grace is a removed one (stalled, or left
        waiting to join); SIGKILL reaches a stopped process too."""
        if self.finished_at is None:
            self.finished_at = time.monotonic()
        elif time.monotonic() - self.finished_at > self.arguments.exit_grace:
            for worker in self.workers:
                print(f"lightning_elche.launch: the fit is over; member {worker.member} is still running after "
                      f"{self.arguments.exit_grace:g} s and is killed", file=sys.stderr, flush=True)
                worker.process.kill()

    def _someone_finished(self) -> bool:
        return 0 in self.exit_codes.values()

    def _over(self) -> bool:
        """Whether the fit is over: a member finished it, or every member failed (on any machine), so a
        replacement or a spare would wait for a place nobody is left to give; those waiting are told."""
        if self._someone_finished() or self.failed:
            return True
        if not any(self.exit_codes.values()) or time.monotonic() - self.cohort_checked_at < COHORT_CHECK_S:
            return False
        self.cohort_checked_at = time.monotonic()
        if cohort_gone(self.store):
            self.failed = True
            end_waiting(self.store)
            print("lightning_elche.launch: every member of the cohort exited with an error; the fit is over, "
                  "no rank replaces them", file=sys.stderr, flush=True)
        return self.failed

    def wait_or_kill(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the running ranks to exit, then kill those left."""
        deadline = time.monotonic() + grace_s
        for worker in self.workers:
            while worker.process.poll() is None and time.monotonic() < deadline:
                time.sleep(POLL_S)  # the launcher's pace of polling its children
            if worker.process.poll() is None:
                worker.process.kill()

    def forward(self, signum: int) -> None:
        """Pass a signal the launcher received on to every running rank. After SIGTERM or SIGINT the fit
        is ending: no rank that exits then is replaced and no spare starts."""
        if signum != signal.SIGUSR1:
            self.stopping = True
            self.stopped_by = signum
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_elche.launch", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc", type=int, required=True,
                        help="ranks to start on this machine")
    parser.add_argument("--nnodes", type=int, default=1, help="machines that start the fit together (not joiners)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="this machine's place among those (0 hosts the store)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv", dest="rdzv", default=None,
                        help="HOST:PORT of the store (default on node 0: 127.0.0.1 and a free port)")
    parser.add_argument("--join", action="store_true", help="these ranks join a running fit at its next boundary")
    parser.add_argument("--replace", action="store_true", help="start a new rank in place of one that fails")
    parser.add_argument("--max-replacements", type=int, default=100, help="with --replace: at most this many")
    parser.add_argument("--spares", type=int, default=0,
                        help="with --replace: ranks started ahead, ready to take a lost rank's place at the next boundary "
                             "(each waits on a member's device and moves to the lost rank's)")
    parser.add_argument("--exit-grace", type=float, default=30.0,
                        help="seconds the other ranks get to exit once one has finished the fit")
    parser.add_argument("--signal-grace", type=float, default=30.0,
                        help="seconds the ranks get to reach a boundary, save and exit after a SIGTERM or SIGINT to the "
                             "launcher (torchrun's agent waits 30 s too); then they are killed")
    parser.add_argument("--store-timeout", type=float, default=LAUNCHER_STORE_ANSWER_S,
                        help="seconds this launcher waits for the rendezvous store to answer a read before it takes "
                             "itself cut off (the store's process died, or a network partition), stops its ranks and "
                             "fails (default %(default)g)")
    parser.add_argument("--cold-start", action="store_true",
                        help="start each rank as a fresh interpreter, not forked from one that imported torch and "
                             "Lightning once (for a script that sets something before importing them); "
                             "ELCHE_COLD_START=1 in the environment does the same")
    parser.add_argument("script")
    return parser


def split_at_script(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments (up to the script, included) and the script's (everything after it).

    argparse alone would read an option after the script that looks like one of the launcher's (an
    abbreviation such as ``--n 5``, or ``-h``) as the launcher's; the script's arguments must reach it
    untouched, as under torchrun."""
    takes_value = {
        option for action in parser._actions if action.nargs != 0 for option in action.option_strings
    }
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return list(argv[:index]) + list(argv[index + 1 : index + 2]), list(argv[index + 2 :])
        if not token.startswith("-") or token == "-":
            return list(argv[: index + 1]), list(argv[index + 1 :])
        index += 2 if token in takes_value else 1  # --flag VALUE, or --flag=VALUE / a switch
    return list(argv), []


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = _parser()
    own, script_args = split_at_script(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    args.script_args = script_args
    if args.nproc < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {args.nproc}")
    if args.join and args.rdzv is None:
        parser.error("--join needs --rdzv-endpoint HOST:PORT, the store of the fit to join")
    if args.spares < 0:
        parser.error(f"--spares must be 0 or more, got {args.spares}")
    if args.store_timeout <= 0:
        parser.error(f"--store-timeout must be more than 0 seconds, got {args.store_timeout:g}")
    if args.spares and not args.replace:
        parser.error("--spares needs --replace: a spare takes a failed rank's place, and a new spare then starts")
    if not args.replace:
        args.max_replacements = 0
    args.cold_start = args.cold_start or os.environ.get(COLD_START_VARIABLE) == "1"
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    # First, before any thread: the zygote is a fork of this process (made as it imported lightning_elche, if it could)
    warm = None if args.cold_start else import_zygote() or WarmStarter()
    hosting = args.node_rank == 0 and not args.join
    host, _, port = (args.rdzv or "127.0.0.1:0").rpartition(":")
    server = None
    if hosting:
        server, store_port = host_store(host, int(port))
    else:
        store_port = int(port)
    world_size = args.nnodes * args.nproc
    environment = {
        **os.environ,
        "MASTER_ADDR": host,
        "MASTER_PORT": str(store_port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(args.nproc),
        "GROUP_RANK": str(args.node_rank),
        "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID", f"elche-{uuid.uuid4().hex[:8]}"),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "ELCHE_ELASTIC": "1",
        "ELCHE_LAUNCHER": uuid.uuid4().hex,
    }
    if hosting:
        print(f"lightning_elche.launch: rendezvous store at {host}:{store_port}", file=sys.stderr, flush=True)
    store = launcher_store(host, store_port, args.store_timeout)
    attach_launcher(store)
    launch = Launch(args, environment, store, warm=warm)
    if hosting:
        reserve_member_ids(store, world_size)
    for slot in range(args.nproc):
        member = next_member_id(store) if args.join else args.node_rank * args.nproc + slot
        launch.start(member, slot, joining=args.join)
    for spare in range(args.spares):  # after the ranks this launcher starts (all of the launch's, on the host)
        launch.hold_spare(spare % args.nproc, ranks_first=args.nproc if args.join else world_size)
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda received, _frame: launch.forward(received))
    try:
        code = launch.watch()
        detach_launcher(store)
        if hosting:
            keep_store_for_other_launchers(store, args.exit_grace)
        return code
    except StoreUnreachable as lost:
        print(f"lightning_elche.launch: {lost}; this machine's ranks are stopped (SIGTERM, then SIGKILL after "
              f"--signal-grace {args.signal_grace:g} s) and the launch fails", file=sys.stderr, flush=True)
        launch.forward(signal.SIGTERM)
        launch.wait_or_kill(args.signal_grace)
        return 1
    finally:
        del server


def keep_store_for_other_launchers(store: BoundedStore, within_s: float) -> None:
    """The hosting launcher's ranks are done; the store stays up until the other machines' launchers are done
    too (at most ``within_s``, ``--exit-grace``: what their ranks get to end once the fit is over; a
    launcher cut off by a partition never detaches), as torchrun's agent keeps its store through an exit
    barrier. A joiner still being admitted, or a rank that records its
    exit, would otherwise find the store gone and fail a fit that ended well."""
    deadline = time.monotonic() + within_s
    while (attached := launchers_attached(store)) > 0:
        if time.monotonic() > deadline:
            print(f"lightning_elche.launch: {attached} other launcher(s) still running {within_s:g} s after this "
                  "machine's ranks ended; the rendezvous store closes", file=sys.stderr, flush=True)
            return
        time.sleep(POLL_S)  # the launcher's pace of polling the store; the last launcher's exit ends the wait


if __name__ == "__main__":
    sys.exit(main())
