"""Launches beyond Lightning's own launcher: torchrun on one node, and the elastic launcher's
warm-started workers. (torchrun on two nodes, with hierarchical averaging, runs between two namespace
hosts: test_multihost.py.)

(Lightning's launcher is what every scenario test uses; SLURM's srun-style start is in
test_slurm.py and test_failures.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import signal
from pathlib import Path

import pytest
from conftest import coverage_report, run_python, start, wait_all

APP = Path(__file__).resolve().parent / "torchrun_app.py"
SAMPLES = 320


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def assert_one_cohort(out: Path, world: int = 2) -> list[dict]:
    """Every rank saw the same boundaries and together they trained every sample of both epochs once."""
    ranks = [json.loads((out / f"final_a0_r{rank}.json").read_text()) for rank in range(world)]
    assert all(rank["boundaries"] == ranks[0]["boundaries"] for rank in ranks) and len(ranks[0]["boundaries"]) > 4
    assert all(rank["global_step"] == ranks[0]["global_step"] > 0 for rank in ranks)
    for epoch in range(2):
        report = coverage_report(ranks, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    return ranks


@pytest.mark.timeout(200)
def test_torchrun_one_node_two_processes(tmp_path):
    command = torchrun("--standalone", "--nproc-per-node=2", str(APP), str(tmp_path))
    [run] = wait_all([start(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True)], 150, what="torchrun")
    assert run.returncode == 0, run.stderr[-4000:]
    assert_one_cohort(tmp_path)


WORKER_SCRIPT = """
import atexit, json, os, signal, sys
from pathlib import Path

out, how = Path(sys.argv[1]), sys.argv[2]
atexit.register(lambda: (out / f"atexit_{how}").write_text("ran"))
(out / f"seen_{how}.json").write_text(json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "member": os.environ.get("ELCHE_MEMBER_ID"),
    "torch_before_first_line": "torch" in sys.modules, "stdin": sys.stdin.read(),
}))
if how == "raise":
    raise ValueError("the script's own error")
if how == "wait":
    signal.pause()  # until the starter kills it
sys.exit(int(how))
"""

# As the launcher does: a WarmStarter made first in a process with no thread (a pytest-xdist worker has
# execnet's), three workers from it, the third killed; every exit code as Popen.poll gives it, in JSON.
STARTER_SCRIPT = """
import json, sys, threading, time
from pathlib import Path
from lightning_elche.lightning.warm_start import WarmStarter

script, out = sys.argv[1], sys.argv[2]
starter = WarmStarter(preload=["torch"])
workers = {how: starter.start(script, [out, how], {"ELCHE_MEMBER_ID": "7"}) for how in ("3", "raise", "wait")}
deadline = time.monotonic() + 60  # polls the condition itself until then: a hang, not a slow start
while not Path(out, "seen_wait.json").exists() and time.monotonic() < deadline:
    time.sleep(0.02)  # the poll's interval: the file's existence ends the wait
workers["wait"].kill()
while any(worker.poll() is None for worker in workers.values()) and time.monotonic() < deadline:
    time.sleep(0.02)  # the poll's interval: every exit reported ends the wait
release = threading.Event()
threading.Thread(target=release.wait).start()
try:
    WarmStarter()
    refused = None
except RuntimeError as error:
    refused = str(error)
release.set()
print(json.dumps({"codes": {how: worker.poll() for how, worker in workers.items()}, "refused": refused}))
"""


@pytest.mark.timeout(120)
def test_a_warm_started_worker_runs_its_script_as_python_would(tmp_path):
    """``lightning_elche.launch`` forks workers from a pre-imported interpreter (its zygote, ``warm_start``):
    the script must see what ``python -u script args`` gives it, and its exit code (a signal's negative,
    1 for an uncaught error), atexit handlers and an empty stdin must be kept. The zygote is a fork of its
    process, so a WarmStarter made once that process has a thread is refused."""
    script = tmp_path / "sub" / "worker.py"
    script.parent.mkdir()
    script.write_text(WORKER_SCRIPT)
    starter = tmp_path / "starter.py"
    starter.write_text(STARTER_SCRIPT)
    proc = run_python([str(starter), str(script), str(tmp_path)], tmp_path, 90, what="the warm starter")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == {"3": 3, "raise": 1, "wait": -signal.SIGKILL}, proc.stderr
    assert "ValueError: the script's own error" in proc.stderr
    assert "before this process starts a thread" in result["refused"]
    for how in ("3", "raise"):
        seen = json.loads((tmp_path / f"seen_{how}.json").read_text())
        assert seen == {"name": "__main__", "argv": [str(script), str(tmp_path), how], "path0": str(script.parent),
                        "member": "7", "torch_before_first_line": True, "stdin": ""}
        assert (tmp_path / f"atexit_{how}").read_text() == "ran"
