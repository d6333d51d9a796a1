"""Multi-machine launches across hosts made of network namespaces (benchmarks/netrig.py), joined by a
rate-limited link: the commands docs/launching.md shows, run as a user on two machines would.

- torchrun with the c10d rendezvous on two hosts, two ranks each, ``strategy="elche"`` with
  hierarchical averaging: the node level stays inside a host, the global level crosses the link;
- the same with ``--max-restarts 1`` and a rank of host 0 killed: both hosts' agents restart their
  workers, which resume from ``last.ckpt`` and train every sample once.

Skipped, with the reason, where namespaces cannot be made (not root); `.ci/run` runs as root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCENARIO, coverage_report, kill_group, wait_all, wait_until
from scenario_config import ScenarioConfig

from benchmarks.netrig import Rig, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no namespace rig here: {REASON}")

APP = Path(__file__).resolve().parent / "torchrun_app.py"
SAMPLES = 320  # torchrun_app's
RDZV_PORT = 29400
LINK_MBIT = 100


def torchrun_on_two_hosts(tmp_path: Path, *app_args: str, restarts: int = 0) -> list[subprocess.CompletedProcess]:
    """docs/launching.md's two-node command, on each host: the same line, its own ``--node-rank``."""
    with Rig(hosts=2, rate_mbit=LINK_MBIT) as rig:
        head = rig.hosts[0]
        agents = [
            host.start(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={host.index}",
                 "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={head.address}:{RDZV_PORT}",
                 "--rdzv-id=elche-multihost", f"--max-restarts={restarts}", "--monitor-interval=0.5",
                 str(APP), str(tmp_path), "--nodes", "2", "--procs", "2", *app_args],
                cwd=tmp_path, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for host in rig.hosts
        ]
        try:
            return wait_all(agents, 240, what="torchrun agents on two namespace hosts")
        finally:
            for agent in agents:
                kill_group(agent)


def results(tmp_path: Path, kind: str, attempt: int) -> list[dict]:
    return [json.loads((tmp_path / f"{kind}_a{attempt}_r{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.timeout(300)
def test_torchrun_across_two_hosts_with_hierarchical_averaging(tmp_path):
    for agent in torchrun_on_two_hosts(tmp_path, "--every", "3"):
        assert agent.returncode == 0, agent.stderr[-4000:]
    ranks = results(tmp_path, "final", attempt=0)
    assert all(rank["boundaries"] == ranks[0]["boundaries"] for rank in ranks) and len(ranks[0]["boundaries"]) > 4
    assert len({rank["global_step"] for rank in ranks}) == 1
    for epoch in range(2):
        report = coverage_report(ranks, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    levels = [level for *_, level in ranks[0]["boundaries"]]
    assert "node" in levels and "global" in levels, levels


@pytest.mark.timeout(400)
def test_torchrun_restarts_both_hosts_workers_after_a_kill_and_resumes_with_exact_coverage(tmp_path):
    """Rank 1 (on host 0) is SIGKILLed in the first attempt, after the first checkpoint: both agents
    restart their workers, which resume from last.ckpt; with what the first attempt checkpointed,
    every sample of both epochs is trained once."""
    agents = torchrun_on_two_hosts(tmp_path, "--kill", restarts=1)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-4000:]
    assert any("exitcode  : -9" in agent.stderr or "exitcode: -9" in agent.stderr for agent in agents)
    checkpointed, resumed = results(tmp_path, "at_checkpoint", 0), results(tmp_path, "final", 1)
    assert checkpointed[0]["global_step"] > 0
    for epoch in range(2):
        report = coverage_report(checkpointed + resumed, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


# --------------------------------------------------------------------------- the elastic launcher

ELASTIC_PORT = 29500


def elastic_launch(host, head, config: ScenarioConfig, nnodes: int, *options: str) -> subprocess.Popen:
    """docs/elastic.md's several-machine command, on ``host``: one rank per host."""
    return host.start(
        [sys.executable, "-m", "lightning_elche.launch", "--nnodes", str(nnodes), "--node-rank", str(host.index),
         "--nproc-per-node", "1", "--rdzv-endpoint", f"{head.address}:{ELASTIC_PORT}", "--exit-grace", "10",
         *options, str(SCENARIO), config.to_json()],
        cwd=config.out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_partitioned_host_leaves_the_elastic_cohort_and_its_rank_exits_with_an_error(tmp_path):
    """Three hosts, one rank each; once every rank has passed a boundary, host 2's link goes down. The
    survivors go on after the timeout and finish with every sample once (the lost window aside); the
    partitioned rank exits with an error naming what it lost instead of hanging."""
    config = ScenarioConfig.from_dict({
        "out": str(tmp_path), "epochs": 2, "samples": 384, "batch_size": 8, "devices": 1,
        "step_sleep_ms": 30,  # a slow step, so that the partition lands mid-fit
        "trainer": {"num_nodes": 3}, "elche": {"elastic": True, "timeout": 10, "anchor": 4},
    })  # fmt: skip
    with Rig(hosts=3, rate_mbit=LINK_MBIT) as rig:
        launchers = [elastic_launch(host, rig.hosts[0], config, 3) for host in rig.hosts]
        try:
            passed = [tmp_path / f"member{member}_at_boundary.json" for member in range(3)]
            wait_until(lambda: all(path.exists() for path in passed), "every rank past a boundary", 150, 0.05)
            rig.hosts[2].link_down()
            finished = wait_all(launchers, 200, what="elastic launchers with host 2 partitioned")
        finally:
            for launcher in launchers:
                kill_group(launcher)
    survivors, partitioned = finished[:2], finished[2]
    for launch in survivors:
        assert launch.returncode == 0, launch.stderr[-4000:]
    assert partitioned.returncode != 0, partitioned.stderr[-4000:]
    print(partitioned.stderr[-3000:])
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["final_digest"] == results[1]["final_digest"]
    lost = json.loads((tmp_path / "member2_at_boundary.json").read_text())
    for epoch in range(config.epochs):
        report = coverage_report([*results, {"trained": lost["trained"]}], config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
