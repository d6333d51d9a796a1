"""Workers forked from an interpreter that imported torch and Lightning once: the ranks of both launchers.

Importing torch and Lightning takes seconds of CPU in every new process (about 7 s on a two-core
machine, 9 s when it is busy). A replacement or a spare that imports them again is late, and takes
that CPU from the ranks still training on the same host. So the launcher forks a *zygote* of itself
as it starts, before it has started a thread (the rendezvous store's server comes after): the zygote
imports torch and ``lightning.pytorch`` (nothing to import where the launcher has them already, as
when it was itself forked from a pre-imported interpreter) and forks each worker on request. The
worker then runs the script as ``python -u script args`` would (``runpy``, ``__name__ == "__main__"``,
its own environment, ``sys.argv`` and ``sys.path[0]``, stdin from ``/dev/null``, atexit handlers run at
its end, the exit code ``python`` would give).

Why not Python's ``forkserver`` (``multiprocessing``), which did this job before: it always starts as a
fresh interpreter, so every launcher paid the imports once more even where it had them; and forking its
server from the launcher instead would take ``multiprocessing``'s private internals, which change
between Python versions. The zygote is ``os.fork`` and two pipes.

Lightning's own launcher (``Trainer(strategy="elche", devices=N)`` run as ``python train.py``) starts
ranks 1..N-1 by running the script again in fresh interpreters. So the first ``import lightning_elche``
in a process that may launch (no rank in its environment, no thread started, not a ``multiprocessing``
child) forks a zygote there and then, once torch and Lightning are imported and before the script has
computed anything: :func:`import_zygote` hands it to the strategy's launcher
(``lightning/warm_launch.py``). The fork costs a copy-on-write page table; a process that never
launches leaves the zygote idle until it exits.

A fork is only as safe as its parent: OpenMP (libgomp) keeps its thread pool across parallel
regions and a forked child that computes with more than one thread waits for the pool's threads,
which it does not have, forever. A script that computed with torch before importing lightning_elche
has that pool, so the zygote checks itself first: a forked probe computes with two threads, and a
probe that has not ended within :data:`PROBE_WITHIN_S` marks the zygote unusable, and its launcher
starts fresh interpreters instead (:class:`ZygoteUnusable`).

The difference a script can see: torch and Lightning are imported before its first line, so an
environment variable it sets itself, before importing them, to change how they import comes too
late. Launch such a script with ``--cold-start`` (the elastic launcher) or ``ELCHE_COLD_START=1`` (both):
each worker is then a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import select
import signal
import sys
import threading
import warnings
from typing import Iterator, NoReturn, Optional, Protocol, Sequence

from lightning_elche.lightning import _lightning

PRELOAD = ("torch", "lightning.pytorch")
REAP_EVERY_S = 0.05  # how soon the zygote reports a worker's exit: the pace of its wait for requests, not a sleep
ZYGOTE_LOST = 1  # the exit code of a worker whose zygote died before it could report it
PROBE_WITHIN_S = 5.0  # a healthy probe ends in milliseconds; one past this waits for OpenMP's missing pool
COLD_START_VARIABLE = "ELCHE_COLD_START"  # "1": every rank a fresh interpreter, no zygote
LAUNCHED_BY = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")  # a rank already; it launches none


class ZygoteUnusable(RuntimeError):
    """The zygote cannot start workers (it died, or forked children of it cannot compute): start fresh
    interpreters instead."""


class WorkerProcess(Protocol):
    """What the launcher uses of a worker: ``subprocess.Popen`` has it, and so has :class:`ForkedWorker`."""

    pid: int

    def poll(self) -> Optional[int]: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedWorker:
    """A worker forked by the zygote, seen as a ``Popen``: its exit code is negative for a signal."""

    def __init__(self, pid: int, starter: WarmStarter) -> None:
        self.pid = pid
        self._starter = starter

    def poll(self) -> Optional[int]:
        return self._starter.exit_code(self.pid)

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended in between
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """Forks the zygote at once (so create it before the launcher starts a thread), then starts workers
    from it. The zygote reaps its workers and reports each exit code; it ends when this process does.
    Only the process that made it may use it (:attr:`owner`): a fork of that process (a DataLoader
    worker, say) closes its copies of the pipes."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        if threading.active_count() > 1:
            raise RuntimeError("WarmStarter must be created before this process starts a thread: its zygote is a fork of it")
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what is buffered is written once, by this process
        with warnings.catch_warnings():  # Python >= 3.12 warns of any thread; OpenBLAS's own survive a fork
            warnings.simplefilter("ignore", DeprecationWarning)
            self._zygote = os.fork()
        if self._zygote == 0:
            os.close(self._requests)
            os.close(self._replies)
            _serve(requests_read, replies_write, preload)
        os.close(requests_read)
        os.close(replies_write)
        self.owner = os.getpid()
        self._closed_in_fork = False
        os.register_at_fork(after_in_child=self._close_in_fork)
        self._lock = threading.Lock()  # Lightning's process observer polls the workers from its own thread
        self._received = b""
        self._exit_codes: dict[int, int] = {}
        self._started: list[int] = []
        self._ready: Optional[bool] = None  # the zygote's self-check: None until it has reported
        self._unusable_because = ""
        self._zygote_lost = False

    def start(self, script: str, args: Sequence[str], env: dict[str, str], cwd: Optional[str] = None) -> ForkedWorker:
        """Fork a worker running ``python -u script args`` (``script`` may be ``-m``, ``args[0]`` the module)
        in ``env`` and ``cwd`` (default: this process's). Raises :class:`ZygoteUnusable` instead where the
        zygote cannot, before any worker has started."""
        while self._ready is None and not self._zygote_lost:
            self._receive(block=True)
        if not self._ready or self._zygote_lost:
            raise ZygoteUnusable(self._unusable_because or "the zygote that forks the ranks has died")
        request = {"script": script, "args": list(args), "env": env, "cwd": cwd or os.getcwd()}
        os.write(self._requests, json.dumps(request).encode() + b"\n")
        while not self._started:
            self._receive(block=True)
            if self._zygote_lost:
                raise ZygoteUnusable("the zygote that forks the ranks has died")
        return ForkedWorker(self._started.pop(0), self)

    def _close_in_fork(self) -> None:
        """In a fork of the owner: close its copies of the pipes, once (its own forks inherit them
        closed, and the numbers may name other files by then)."""
        if self._closed_in_fork:
            return
        self._closed_in_fork = True
        for descriptor in (self._requests, self._replies):
            os.close(descriptor)

    def exit_code(self, pid: int) -> Optional[int]:
        """The worker's exit code once the zygote has reported it (``Popen.poll``'s convention)."""
        if pid not in self._exit_codes and not self._zygote_lost:
            self._receive(block=False)
        if pid not in self._exit_codes and self._zygote_lost and not process_alive(pid):
            self._exit_codes[pid] = ZYGOTE_LOST
        return self._exit_codes.get(pid)

    def _receive(self, block: bool) -> None:
        with self._lock:
            while select.select([self._replies], [], [], None if block else 0)[0]:
                chunk = os.read(self._replies, 65536)
                if not chunk:
                    self._zygote_lost = True
                    return
                *lines, self._received = (self._received + chunk).split(b"\n")
                for line in lines:
                    self._take(json.loads(line))
                block = False

    def _take(self, reply: dict) -> None:
        if "started" in reply:
            self._started.append(reply["started"])
        elif "exited" in reply:
            self._exit_codes[reply["exited"]] = reply["code"]
        else:
            self._ready = reply["ready"]
            self._unusable_because = reply.get("because", "")


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve(requests: int, replies: int, preload: Sequence[str]) -> NoReturn:
    """The zygote: fork a worker per request, report each exit; end when the launcher closes the requests."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to forward, not ours to die of
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)  # the launcher's forwarding handlers are not ours
        for module in preload:
            __import__(module)
        usable = _forked_children_compute()
        because = "" if usable else (
            f"a process forked from it did not finish a two-thread computation within {PROBE_WITHIN_S:g} s: "
            "torch computed before lightning_elche was imported, and OpenMP's thread pool does not survive a fork"
        )
        os.write(replies, json.dumps({"ready": usable, "because": because}).encode() + b"\n")
        pending = b""
        while True:
            ready = select.select([requests], [], [], REAP_EVERY_S)[0]
            _report_exits(replies)
            if not ready:
                continue
            chunk = os.read(requests, 65536)
            if not chunk:
                _exit(0)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    try:
                        os.close(requests)
                        os.close(replies)
                        run_script(request["script"], request["args"], request["env"], request["cwd"])
                    except BaseException:
                        sys.excepthook(*sys.exc_info())
                    finally:
                        _exit(1)  # run_script exits with the script's code; only its own failure gets here
                os.write(replies, json.dumps({"started": pid}).encode() + b"\n")
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    _exit(code)


def _forked_children_compute() -> bool:
    """Whether a child forked from this process can compute with two OpenMP threads (the module's
    docstring). Without torch imported there is nothing to check."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    probe = os.fork()
    if probe == 0:
        torch.set_num_threads(2)
        torch.ones(1 << 20).add_(1)  # above ATen's grain size: split across the two threads
        os._exit(0)
    ended = os.pidfd_open(probe)
    try:
        if not select.select([ended], [], [], PROBE_WITHIN_S)[0]:
            os.kill(probe, signal.SIGKILL)
        return os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) == 0
    finally:
        os.close(ended)


def exited_children() -> Iterator[tuple[int, int]]:
    """Reap each child of this process that has exited: its pid and exit code (``Popen.returncode``'s
    convention, negative for a signal). Returns at once when none has."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _report_exits(replies: int) -> None:
    for pid, code in exited_children():
        os.write(replies, json.dumps({"exited": pid, "code": code}).encode() + b"\n")


def _exit(code: int) -> NoReturn:
    os._exit(code)  # not the launcher's atexit handlers, nor its buffered output


def run_script(script: str, args: list[str], env: dict[str, str], cwd: str) -> NoReturn:
    """In the forked worker: become ``python -u script args`` with ``env``, and exit as it would."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the launcher's handlers are not the script's
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = os.getcwd() if script == "-m" else os.path.dirname(os.path.abspath(script))
    _forget_interrupted_imports()
    if sys.stdin is not None:
        sys.stdin.close()
        sys.stdin = open(os.devnull)  # noqa: SIM115  # for the process's life, as multiprocessing gives its children
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]  # -u; typeshed's TextIO lacks it
    code = run_as_main([script, *args])
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _exit(code)


def _forget_interrupted_imports() -> None:
    """A zygote forked by ``import lightning_elche`` (:func:`fork_at_import`) was forked in the middle of
    that import and of the imports that led to it (a module of the script's own that imports
    lightning_elche, say). Those others are dropped, for the script to import them afresh rather than
    find them half run. lightning_elche itself had run to its end: its import, still under way, is this
    thread's own (it holds the module's import lock), so the script's ``import lightning_elche`` returns it."""
    for name, module in list(sys.modules.items()):
        if name != "lightning_elche" and getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]


def run_as_main(argv: Sequence[str]) -> int:
    """Run ``argv`` (``script.py args...`` or ``-m module args...``) as ``__main__`` in this (forked)
    interpreter, with ``sys.argv`` as python sets it; its exit code as ``python <argv>`` gives it."""
    _lightning.read_rank_zero_again()
    try:
        if argv[0] == "-m":  # run_module(alter_sys=True) puts the module's file in sys.argv[0], as python -m
            sys.argv = list(argv[1:])
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it (torch prefixes "[rank<r>]:")
        return 1


_import_zygote: Optional[WarmStarter] = None  # the zygote fork_at_import made, in the process that made it


def fork_at_import() -> None:
    """Fork the zygote as lightning_elche is first imported, where this process may launch ranks with
    Lightning's launcher (the module's docstring): torch and Lightning are imported by then and the
    script has not computed yet. A process that is a rank already, has started a thread, is a
    ``multiprocessing`` child or was told ``ELCHE_COLD_START=1`` makes none."""
    global _import_zygote
    if (
        sys.platform == "linux" and os.environ.get(COLD_START_VARIABLE) != "1"
        and not any(name in os.environ for name in LAUNCHED_BY)
        and multiprocessing.parent_process() is None and threading.active_count() == 1
    ):  # fmt: skip
        _import_zygote = WarmStarter(preload=())


def import_zygote() -> Optional[WarmStarter]:
    """The zygote this process forked as it imported lightning_elche, if it did (a fork of that process
    inherits the object, not the zygote: it gets None)."""
    if _import_zygote is None or _import_zygote.owner != os.getpid() or os.environ.get(COLD_START_VARIABLE) == "1":
        return None
    return _import_zygote
