"""Workers forked from an interpreter that imported torch and Lightning once, for the elastic launcher.

Importing torch and Lightning takes seconds of CPU in every new process (about 9 s on a busy
two-core machine). A replacement or a spare that imports them again is late, and takes that CPU
from the ranks still training on the same host. So the launcher starts Python's ``forkserver``
(``multiprocessing``, the engine ``torch.multiprocessing`` and DataLoader workers use too) with
torch and ``lightning.pytorch`` imported, and forks each worker from it: the worker then runs the
script as ``python -u script args`` would (``runpy``, ``__name__ == "__main__"``, its own
environment, ``sys.argv`` and ``sys.path[0]``, atexit handlers run at its end).

The difference a script can see: torch and Lightning are imported before its first line, so an
environment variable it sets itself, before importing them, to change how they import comes too
late. Launch such a script with ``--cold-start``: each worker is then a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import sys
from typing import Optional, Protocol, Sequence

PRELOAD = ("torch", "lightning.pytorch")


class WorkerProcess(Protocol):
    """What the launcher uses of a worker: ``subprocess.Popen`` has it, and so has :class:`ForkedWorker`."""

    pid: int

    def poll(self) -> Optional[int]: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedWorker:
    """A worker forked by the forkserver, seen as a ``Popen``: its exit code is negative for a signal."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid = process.pid

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended in between
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """Starts workers from the forkserver (started, with ``PRELOAD`` imported, at the first worker)."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))

    def start(self, script: str, args: Sequence[str], env: dict[str, str]) -> ForkedWorker:
        process = self._context.Process(target=run_script, args=(script, list(args), env), name=f"worker:{script}")
        process.start()
        return ForkedWorker(process)


def run_script(script: str, args: list[str], env: dict[str, str]) -> None:
    """In the forked worker: become ``python -u script args`` with ``env``."""
    atexit._clear()  # the forkserver's handlers are not the script's
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]  # -u; typeshed's TextIO lacks it
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:  # Lightning read the rank from the forkserver's environment at import
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
