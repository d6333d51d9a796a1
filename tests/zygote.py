"""A pre-imported interpreter that forks the test scenarios' processes (a fork server, as
``multiprocessing``'s forkserver, for scripts).

Importing torch and Lightning costs about 8 s of CPU per process on the 2-core CI machine, and
each multi-process test starts several processes: most of the suite's time went into imports.
The zygote imports them once; each request names a script (or a module), its arguments, environment
and working directory, and the zygote forks a child that starts a session of its own, sends its output
to the files named, and runs the script as ``__main__``, as ``python script args`` (``python -m module
args``) would. The child is a
real process (its own pid, session, signals, process group). The scripts include the launchers
(``python -m lightning_elche.launch``, which then forks its ranks from a zygote of its own, a fork of
itself with these imports: ``lightning_elche/lightning/warm_start.py``, whose ``run_as_main`` runs the script
here too); the ranks torchrun launches are fresh interpreters, and those Lightning's launcher starts
for a scenario are forked by the scenario itself (``tests/prefork.py``): only the parent's imports are shared.
The zygote reaps its children and writes each exit status (``Popen.returncode``'s convention:
negative for a signal) to ``<status_dir>/<pid>``, which the test side waits on.

Protocol, one JSON object per line: request ``{"argv", "env", "cwd", "stdout", "stderr"}`` (``argv``:
``script.py args...`` or ``-m module args...``) on
stdin, reply ``{"pid"}`` on stdout. EOF on stdin ends the zygote; its running children go on.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import sys
import warnings
from pathlib import Path

from lightning_elche.lightning.warm_start import exited_children, run_as_main

PRELOADED = (
    "torch", "torch.distributed", "lightning.pytorch", "lightning.pytorch.callbacks", "lightning.pytorch.loggers",
    "lightning.fabric.utilities.distributed", "torchmetrics", "lightning_elche",
)  # fmt: skip


def _reap(status_dir: Path) -> None:
    for pid, code in exited_children():
        partial = status_dir / f"{pid}.partial"
        partial.write_text(str(code))
        partial.rename(status_dir / str(pid))


def _run_child(request: dict) -> None:
    """In the forked child: become ``python <argv>`` in a session of its own, then exit."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # PYTHONUNBUFFERED
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        # python -m puts the working directory first on the path, python script.py the script's folder
        sys.path[0] = request["cwd"] if argv[0] == "-m" else str(Path(argv[0]).resolve().parent)
        warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore (the only setting routed here)
        code = run_as_main(argv)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(status_dir: Path) -> None:
    os.environ["ELCHE_COLD_START"] = "1"  # no zygote of lightning_elche's own here: its forks could not use it
    for module in PRELOADED:
        __import__(module)
    del os.environ["ELCHE_COLD_START"]
    requests = sys.stdin.buffer
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        _reap(status_dir)
        if not ready:
            continue
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
