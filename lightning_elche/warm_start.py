"""Workers forked from an interpreter that imported torch and Lightning once, for the elastic launcher.

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

The difference a script can see: torch and Lightning are imported before its first line, so an
environment variable it sets itself, before importing them, to change how they import comes too
late. Launch such a script with ``--cold-start``: each worker is then a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import threading
from typing import Iterator, NoReturn, Optional, Protocol, Sequence

PRELOAD = ("torch", "lightning.pytorch")
REAP_EVERY_S = 0.05  # how soon the zygote reports a worker's exit: the pace of its wait for requests, not a sleep
ZYGOTE_LOST = 1  # the exit code of a worker whose zygote died before it could report it


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
    from it. The zygote reaps its workers and reports each exit code; it ends when this process does."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        if threading.active_count() > 1:
            raise RuntimeError("WarmStarter must be created before this process starts a thread: its zygote is a fork of it")
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what is buffered is written once, by this process
        self._zygote = os.fork()
        if self._zygote == 0:
            os.close(self._requests)
            os.close(self._replies)
            _serve(requests_read, replies_write, preload)
        os.close(requests_read)
        os.close(replies_write)
        self._received = b""
        self._exit_codes: dict[int, int] = {}
        self._started: list[int] = []
        self._zygote_lost = False

    def start(self, script: str, args: Sequence[str], env: dict[str, str]) -> ForkedWorker:
        os.write(self._requests, json.dumps({"script": script, "args": list(args), "env": env}).encode() + b"\n")
        while not self._started:
            self._receive(block=True)
            if self._zygote_lost:
                raise RuntimeError("lightning_elche.launch: the zygote that forks the ranks has died; run with --cold-start")
        return ForkedWorker(self._started.pop(0), self)

    def exit_code(self, pid: int) -> Optional[int]:
        """The worker's exit code once the zygote has reported it (``Popen.poll``'s convention)."""
        if pid not in self._exit_codes and not self._zygote_lost:
            self._receive(block=False)
        if pid not in self._exit_codes and self._zygote_lost and not process_alive(pid):
            self._exit_codes[pid] = ZYGOTE_LOST
        return self._exit_codes.get(pid)

    def _receive(self, block: bool) -> None:
        while select.select([self._replies], [], [], None if block else 0)[0]:
            chunk = os.read(self._replies, 65536)
            if not chunk:
                self._zygote_lost = True
                return
            *lines, self._received = (self._received + chunk).split(b"\n")
            for line in lines:
                reply = json.loads(line)
                if "started" in reply:
                    self._started.append(reply["started"])
                else:
                    self._exit_codes[reply["exited"]] = reply["code"]
            block = False


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
                        run_script(request["script"], request["args"], request["env"])
                    except BaseException:
                        sys.excepthook(*sys.exc_info())
                    finally:
                        _exit(1)  # run_script exits with the script's code; only its own failure gets here
                os.write(replies, json.dumps({"started": pid}).encode() + b"\n")
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    _exit(code)


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


def run_script(script: str, args: list[str], env: dict[str, str]) -> NoReturn:
    """In the forked worker: become ``python -u script args`` with ``env``, and exit as it would."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the launcher's handlers are not the script's
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
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


def run_as_main(argv: Sequence[str]) -> int:
    """Run ``argv`` (``script.py args...`` or ``-m module args...``) as ``__main__`` in this (forked)
    interpreter, with ``sys.argv`` as python sets it; its exit code as ``python <argv>`` gives it."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:  # Lightning read the rank from the parent's environment at import
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
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
