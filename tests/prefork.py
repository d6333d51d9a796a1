"""Ranks forked ahead for Lightning's launcher, so that they need not import torch and Lightning again.

Lightning's launcher starts ranks 1..N-1 by running the script again (``subprocess.Popen([python,
script, *args])``), and each fresh interpreter spends about 8 s of CPU on imports on the 2-core CI
machine. A scenario forked by the zygote (``tests/zygote.py``) has them imported already and has
run nothing yet, so it is as safe to fork as the zygote: :func:`fork_ranks` forks N-1 children
there, at the script's start, and points the launcher's ``Popen`` at them. Each child waits for
the command, environment and working directory the launcher would have used, becomes that command
(``runpy``, as the zygote's children do) and exits with its status. They are the scenario's own
children, in its session: the launcher sees and signals them through :class:`ForkedRank`, and the
tests' ``kill_group`` ends them with it. A child that no launch asks for ends when the scenario does.

(lightning_elche does the same for a user's script: its zygote is forked as the script imports
lightning_elche (``lightning_elche/lightning/warm_start.py``). A scenario forked from the tests' zygote
finds lightning_elche imported already, so it has no such zygote of its own, and forks here instead;
``tests/test_warm_launch.py`` starts fresh interpreters to test lightning_elche's.)
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import types
from typing import Any, Optional

from lightning_elche.lightning.warm_start import run_as_main

EXTERNAL_LAUNCH = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "ELCHE_ELASTIC")
RANKS_END_WITHIN_S = 60.0  # after the script's own rank has finished the fit, the others' ends (result files) at most
_launched: list[ForkedRank] = []  # the ranks Lightning's launcher took, in launch order


class ForkedRank:
    """A forked child as Lightning's launcher uses a ``subprocess.Popen``: poll, wait, signals, returncode."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it ended, how is unknown
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_ranks(devices: int) -> None:
    """In a script Lightning's launcher will re-run for ``devices - 1`` more ranks: fork them now."""
    if devices < 2 or any(name in os.environ for name in EXTERNAL_LAUNCH):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    waiting: list[tuple[int, int]] = []  # (pid, the write end of its pipe)
    for _ in range(devices - 1):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the pipes' write ends stay with the scenario alone, so that its exit reads as EOF
            for _, held in [*waiting, (pid, write)]:
                os.close(held)
            _become_the_launched_rank(read)
        os.close(read)
        waiting.append((pid, write))
    _route_lightning_launches(waiting)


def _route_lightning_launches(waiting: list[tuple[int, int]]) -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script

    script = os.path.abspath(sys.argv[0])

    def popen(command: Any, *args: Any, **kwargs: Any) -> Any:
        if waiting and not args and set(kwargs) <= {"env", "cwd"} and list(command[:2]) == [sys.executable, script]:
            pid, write = waiting.pop(0)
            order = {"argv": list(command[1:]), "env": dict(kwargs.get("env") or os.environ),
                     "cwd": kwargs.get("cwd") or os.getcwd()}
            os.write(write, (json.dumps(order) + "\n").encode())
            os.close(write)
            _launched.append(ForkedRank(pid, list(command)))
            return _launched[-1]
        return subprocess.Popen(command, *args, **kwargs)

    subprocess_script.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})  # type: ignore[attr-defined]


def wait_for_ranks() -> None:
    """Once the script's own rank (rank 0) has finished: wait for the ranks it launched, and fail if one
    failed, as torchrun's agent ends only when its last worker has. Lightning's launcher does not wait for
    them, so without this a test would read the results while a slower rank is still writing its own."""
    for rank in _launched:
        code = rank.wait(RANKS_END_WITHIN_S)
        if code != 0:
            sys.exit(f"a rank launched as {rank.args[2:]} exited with {code}")


def _become_the_launched_rank(read: int) -> None:
    """In a forked child: wait for the launcher's command (EOF: none came, exit), run it, exit with its status."""
    code = 0
    try:
        with os.fdopen(read, "rb") as orders:
            line = orders.readline()
        if not line:
            return
        order = json.loads(line)
        code = 1
        atexit._clear()  # the scenario's handlers are its own; the rank registers its own
        os.chdir(order["cwd"])
        os.environ.clear()
        os.environ.update(order["env"])
        code = run_as_main(order["argv"])
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
