"""How the benchmarks run their jobs, and how a run ends.

A measured job runs in fresh interpreters (``lightning_elche._jobs.run_job``), as a user's job
would: its start-up and its memory are a real job's. A smoke run only asks whether every code path
still runs, and a fresh interpreter spends about 8 s of CPU importing torch and Lightning, more
than a smoke job trains; so a smoke run forks its jobs from the benchmark's own interpreter, ranks
included: the ranks Lightning's launcher would start as new interpreters are forked ahead, and the
launcher's ``Popen`` hands each one its environment instead (as ``tests/prefork.py`` does for the
tests' scenarios). The benchmarks whose subject is a launcher (torchrun, ``lightning_elche.launch``)
start it in a session of its own (:func:`run_in_session`), so that a hang ends every process it
started, and their ranks write what the driver reads atomically (:func:`write_atomically`). The
peers' plain PyTorch jobs (torchft, Hivemind) have no launcher: :func:`run_ranks` starts their ranks.

A run ends the same way everywhere (:func:`conclude`): the results JSON written, the tables the
README shows printed from that JSON, and a non-zero exit status when a configuration failed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Union

from benchmarks.provenance import REPO, RESULTS, Failures, write_results

Worker = Callable[[dict[str, Any]], None]


def results_path(module: str, args: argparse.Namespace) -> Path:
    """``--json``, else ``benchmarks/results/<module>.json`` (``<module>_quick.json`` for a quick run);
    a smoke run's default is in the temporary folder, never over the kept figures."""
    if args.json is not None:
        return Path(args.json)
    if getattr(args, "smoke", False):
        return Path(tempfile.gettempdir()) / f"elche-{module}-smoke.json"
    return RESULTS / f"{module}{'_quick' if getattr(args, 'quick', False) else ''}.json"


def conclude(benchmark: str, args: argparse.Namespace, results: Any, failures: Failures,
             tables: Callable[[dict[str, Any]], dict[str, str]], **extra: Any) -> NoReturn:
    """Write the results, print the tables from what was written, exit 1 if a configuration failed."""
    path = write_results(args.json, benchmark, args, results, failures, **extra)
    for name, text in tables(json.loads(path.read_text())).items():
        print(f"\n{name}:\n\n{text}", flush=True)
    sys.exit(1 if failures.records else 0)


def cell(value: Optional[dict[str, float]], spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    """``median (min-max)`` of a spread (``(-0.47 to +0.15)`` when the bounds carry a sign), the
    median alone when the three read the same, or ``-``."""
    if value is None:
        return "-"
    median, low, high = (format(value[key] * scale, spec) for key in ("median", "min", "max"))
    if value.get("n") == 1 or low == high:
        return median + unit
    return f"{median}{unit} ({low}{' to ' if low[0] in '+-' else '-'}{high})"


def failed(record: dict[str, Any], name: str) -> int:
    """Runs of configuration ``name`` that failed."""
    return sum(failure["configuration"] == name for failure in record["failures"])


def write_atomically(path: Path, record: dict[str, Any]) -> None:
    """Write then rename, so that a driver never reads half a record (a kill can strike mid-write)."""
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(record))
    partial.replace(path)


class BenchmarkFailed(RuntimeError):
    """A launched job (torchrun, ``lightning_elche.launch``) hung, failed, or left results that do not add up."""


def run_in_session(
    command: list[str], log: Path, env: dict[str, str], timeout: float, on_poll: Callable[[], None],
    what: Callable[[], str],
) -> float:
    """Run a job in a session of its own, so that whatever happens every process of it can be ended at
    once; ``on_poll()`` every 0.1 s (a driver's kills). Returns the wall time; raises
    :class:`BenchmarkFailed` past ``timeout`` or when the job exits non-zero, with the log's tail and
    ``what()`` naming the job."""
    with open(log, "w") as out:
        launched = time.time()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(0.1)
                if time.time() - launched > timeout:
                    raise BenchmarkFailed(f"{what()}: the job ran past --timeout {timeout:.0f} s; see {log}")
                on_poll()
            wall = time.time() - launched
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        raise BenchmarkFailed(f"{what()} exited {proc.returncode}; the job's files are in {log.parent}:\n{log.read_text()[-3000:]}")
    return wall


def both_at_once(solo: Callable[[int], float]) -> list[float]:
    """``solo(rank)`` for ranks 0 and 1, run at the same time (as the two ranks of a cohort share the machine);
    a solo's error is raised here, in the caller's thread, so that the pair fails as one configuration."""
    results = [0.0, 0.0]
    errors: list[BaseException] = []

    def run_one(rank: int) -> None:
        try:
            results[rank] = solo(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run_one, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def run_ranks(
    module: str, name: str, rank_configs: list[dict[str, Any]], out: Path, env: Union[dict[str, str], list[dict[str, str]]],
    timeout: float, end_leftovers: Callable[[int], None] = lambda session: None,
) -> list[dict[str, Any]]:
    """Run ``python -m module --worker CONFIG`` once per rank (a plain PyTorch job, no launcher), each
    rank in a session of its own (``env``: one environment for all, or one per rank), and return the
    reports the ranks write to ``out/rank<r>.json``.

    A rank that exits non-zero, a job past ``timeout`` or a missing report raises
    :class:`lightning_elche._jobs.JobFailed` with the ranks' stderr; whatever happens every rank is
    killed on the way out, and ``end_leftovers(session)`` ends what a rank started outside its
    process group (a daemon of a peer library)."""
    from lightning_elche._jobs import JobFailed

    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, config in enumerate(rank_configs):
            (out / f"rank{rank}.json").unlink(missing_ok=True)  # a report is this run's or none
            with open(out / f"rank{rank}.out", "w") as stdout, open(out / f"rank{rank}.err", "w") as stderr:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, "--worker", json.dumps(config)], cwd=str(REPO),
                    env=env if isinstance(env, dict) else env[rank],
                    stdout=stdout, stderr=stderr, start_new_session=True,
                ))  # fmt: skip
        deadline = time.monotonic() + timeout
        while (codes := [p.poll() for p in procs]) != [0] * len(procs):
            failed = next((r for r, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                raise JobFailed(f"{name}: rank {failed} failed (exit {codes[failed]}):\n{_tail(out / f'rank{failed}.err')}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"rank {r}:\n{_tail(out / f'rank{r}.err', 1500)}" for r in range(len(procs)))
                raise JobFailed(f"{name} did not finish within {timeout:.0f} s; ranks killed\n{tails}")
            time.sleep(0.05)
        return _reports(out, len(procs), lambda rank: f"{name}: rank {rank} wrote no report:\n{_tail(out / f'rank{rank}.err')}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            end_leftovers(p.pid)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="backslashreplace")[-chars:] if path.exists() else ""


def run_job(module: str, worker: Worker, config: dict[str, Any], ranks: int, timeout: float, warm: bool) -> list[dict]:
    """``worker(config)`` on ``ranks`` ranks: fresh interpreters, or forked from this one when ``warm``."""
    if not warm:
        from lightning_elche._jobs import run_job as run_fresh

        return run_fresh(module, config, ranks=ranks, timeout=timeout, cwd=str(REPO))
    return _forked_job(worker, config, ranks, timeout)


def _forked_job(worker: Worker, config: dict[str, Any], ranks: int, timeout: float) -> list[dict]:
    from lightning_elche._jobs import JobFailed

    name = config.get("name", "job")
    with tempfile.TemporaryDirectory(prefix="elche-job-") as folder:
        config = dict(config, out=folder)
        output = Path(folder) / "output"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _be_the_job(worker, config, ranks, output)
        status = _wait(pid, timeout)
        _kill_session(pid)  # a rank that outlived the job
        tail = _tail(output)
        if status is None:
            raise JobFailed(f"{name} did not finish within {timeout:.0f} s:\n{tail}")
        if status != 0:
            raise JobFailed(f"{name} failed (exit {status}):\n{tail}")
        return _reports(Path(folder), ranks, lambda rank: f"{name}: rank {rank} wrote no report:\n{tail}")


def _reports(folder: Path, ranks: int, missing: Callable[[int], str]) -> list[dict[str, Any]]:
    """Every rank's ``rank<r>.json``; ``missing(rank)`` is the error when one wrote none."""
    from lightning_elche._jobs import JobFailed

    reports = []
    for rank in range(ranks):
        path = folder / f"rank{rank}.json"
        if not path.exists():
            raise JobFailed(missing(rank))
        reports.append(json.loads(path.read_text()))
    return reports


def _wait(pid: int, timeout: float) -> Optional[int]:
    """The job's exit status, or ``None`` when it ran past ``timeout`` (then its session is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    _kill_session(pid)
    os.waitpid(pid, 0)
    return None


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _ForkedRank:
    """A rank forked ahead, as Lightning's launcher and its child-process observer use a ``Popen``."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()  # the observer thread polls too

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
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


def _be_the_job(worker: Worker, config: dict[str, Any], ranks: int, output: Path) -> NoReturn:
    """In the forked job: a session of its own, output to ``output``, rank 0's ``worker(config)``,
    then the launched ranks' exit statuses."""
    code = 1
    try:
        os.setsid()
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        atexit._clear()  # the driver's handlers are the driver's
        waiting = _fork_ranks(ranks - 1, worker, config)
        launched: list[_ForkedRank] = []
        _route_launches(waiting, launched)
        code = _run_worker(worker, config)
        for _, write in waiting:  # a rank no launch asked for reads EOF and ends
            os.close(write)
        for pid, _ in waiting:
            os.waitpid(pid, 0)
        for rank in launched:
            code = code or rank.wait()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork_ranks(count: int, worker: Worker, config: dict[str, Any]) -> list[tuple[int, int]]:
    """``count`` children waiting for a launcher's environment; (pid, write end of its pipe) each."""
    waiting: list[tuple[int, int]] = []
    for _ in range(count):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            for _, held in [*waiting, (0, write)]:
                os.close(held)
            _be_a_rank(read, worker, config)
        os.close(read)
        waiting.append((pid, write))
    return waiting


def _route_launches(waiting: list[tuple[int, int]], launched: list[_ForkedRank]) -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script

    def popen(command: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> _ForkedRank:
        pid, write = waiting.pop(0)
        os.write(write, json.dumps(dict(env if env is not None else os.environ)).encode())
        os.close(write)
        launched.append(_ForkedRank(pid, list(command)))
        return launched[-1]

    subprocess_script.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})  # type: ignore[attr-defined]


def _be_a_rank(read: int, worker: Worker, config: dict[str, Any]) -> NoReturn:
    code = 1
    try:
        with os.fdopen(read, "rb") as orders:
            environment = orders.read()
        if not environment:
            code = 0
            return
        os.environ.clear()
        os.environ.update(json.loads(environment))
        code = _run_worker(worker, config)
    finally:
        os._exit(code)


def _run_worker(worker: Worker, config: dict[str, Any]) -> int:
    """``worker(config)`` as ``main_or_worker`` runs it in a fresh interpreter; its exit status."""
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    from lightning_elche.comm.groups import destroy_process_group_at_exit

    rank_zero_only.rank = _get_rank() or 0  # Lightning reads it from the environment at import
    destroy_process_group_at_exit()
    code = 0
    try:
        worker(config)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code
