"""Launches beyond Lightning's own launcher: torchrun on one node and on two nodes over loopback, and
the elastic launcher's warm-started workers.

(Lightning's launcher is what every scenario test uses; SLURM's srun-style start is in
test_slurm.py and test_failures.py.)
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import coverage_report, start, wait_all

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


@pytest.mark.timeout(200)
def test_torchrun_two_nodes_on_loopback_with_hierarchical_averaging(tmp_path):
    """Two torchrun agents (node ranks 0 and 1, two processes each) meeting over 127.0.0.1:
    Trainer(num_nodes=2, devices=2), ElCheStrategy(node_sync_every=3). The nodes average every
    window, all four ranks every third window and at each epoch's end; coverage is exact."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [
        start(
            torchrun(
                "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={port}", str(APP), str(tmp_path), "--nodes", "2", "--procs", "2", "--every", "3",
            ),
            cwd=tmp_path, stderr=subprocess.PIPE, text=True,
        )
        for node in range(2)
    ]
    for run in wait_all(nodes, 150, what="torchrun agents"):
        assert run.returncode == 0, run.stderr[-4000:]
    boundaries = assert_one_cohort(tmp_path, world=4)[0]["boundaries"]
    levels = [level for *_, level in boundaries]
    assert "node" in levels and "global" in levels
    since_global = 0
    for index, (epoch, *_, level) in enumerate(boundaries):
        since_global = 0 if level == "global" else since_global + 1
        assert since_global < 3, f"boundary {index}: three node-level boundaries in a row"
        if index + 1 == len(boundaries) or boundaries[index + 1][0] != epoch:
            assert level == "global", f"epoch {epoch} ends without a global average"


WORKER_SCRIPT = """
import atexit, json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
(out / "seen.json").write_text(json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "member": os.environ.get("ELCHE_MEMBER_ID"),
    "torch_before_first_line": "torch" in sys.modules,
}))
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.timeout(120)
def test_a_warm_started_worker_runs_its_script_as_python_would(tmp_path):
    """``lightning_elche.launch`` forks workers from a pre-imported interpreter (``warm_start``): the script
    must see what ``python -u script args`` gives it, and its exit code and atexit handlers must be kept."""
    from lightning_elche.warm_start import WarmStarter

    script = tmp_path / "sub" / "worker.py"
    script.parent.mkdir()
    script.write_text(WORKER_SCRIPT)
    worker = WarmStarter(preload=["torch"]).start(str(script), [str(tmp_path), "3"], {"ELCHE_MEMBER_ID": "7"})
    deadline = time.monotonic() + 90  # polls its exit (the condition itself) until then: a hang, not a slow start
    while worker.poll() is None:
        if time.monotonic() > deadline:
            worker.kill()
            pytest.fail("the warm-started worker did not exit within 90 s")
        time.sleep(0.05)
    assert worker.poll() == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"name": "__main__", "argv": [str(script), str(tmp_path), "3"], "path0": str(script.parent),
                    "member": "7", "torch_before_first_line": True}
    assert (tmp_path / "atexit").read_text() == "ran"
