"""Multi-machine launches across hosts made of network namespaces (benchmarks/netrig.py), joined by a
rate-limited link: the commands docs/launching.md and docs/elastic.md show, run as a user on several
machines would.

- torchrun with the c10d rendezvous on two hosts, two ranks each, ``strategy="elche"`` with
  hierarchical averaging: the bytes each host sent show the node level inside a host (loopback) and
  the global level across the link; the same with ``--max-restarts 1`` and a rank of host 0 killed:
  both hosts' agents restart their workers, which resume from ``last.ckpt`` and train every sample once;
- the link model (cohort/link.py) against the real link, and the slow-link benchmark's real-link run;
- the elastic launcher with a host cut off mid-fit, two hosts and three (the store's side trains on,
  the side cut off from the store exits with an error naming it), and a host joining a running fit.

Skipped, with the reason, where namespaces cannot be made (not root); `.ci/run` runs as root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCENARIO, coverage_report, kill_group, launcher_notes, run_python, wait_all, wait_until
from scenario_config import ScenarioConfig

from benchmarks.netrig import Rig, unavailable
from lightning_elche.cohort.link import SEGMENT_PAYLOAD_BYTES, link_ms

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no namespace rig here: {REASON}")

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "torchrun_app.py"
SAMPLES = 320  # torchrun_app's
RDZV_PORT = 29500  # docs/launching.md's (each rig is a network of its own)
LINK_MBIT = 100


Traffic = list[dict[str, int]]  # per host, the bytes it sent on each interface


def torchrun_on_two_hosts(
    tmp_path: Path, *app_args: str, restarts: int = 0
) -> tuple[list[subprocess.CompletedProcess], Traffic]:
    """docs/launching.md's two-node command, on each host: the same line, its own ``--node-rank``.
    Returns the agents and, per host, the bytes it sent over the fit on its link (``eth0``) and on
    its loopback (``lo``)."""
    with Rig(hosts=2, rate_mbit=LINK_MBIT) as rig:
        head = rig.hosts[0]
        before = [{interface: host.sent_bytes(interface) for interface in ("eth0", "lo")} for host in rig.hosts]
        agents = [
            host.start(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={host.index}",
                 "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={head.address}:{RDZV_PORT}",
                 f"--max-restarts={restarts}", str(APP), str(tmp_path), "--nodes", "2", "--procs", "2", *app_args],
                cwd=tmp_path, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for host in rig.hosts
        ]
        try:
            finished = wait_all(agents, 240, what="torchrun agents on two namespace hosts")
        finally:
            for agent in agents:
                kill_group(agent)
        traffic = [
            {interface: host.sent_bytes(interface) - sent[interface] for interface in sent}
            for host, sent in zip(rig.hosts, before)
        ]
    return finished, traffic


def results(tmp_path: Path, kind: str, attempt: int) -> list[dict]:
    return [json.loads((tmp_path / f"{kind}_a{attempt}_r{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.timeout(300)
def test_torchrun_across_two_hosts_with_hierarchical_averaging(tmp_path):
    """2 hosts x 2 ranks, ``ranks_per_node=2``, a global average every 4th boundary, a model of 1 MB (a
    hidden layer 20,000 wide), one step a window and no step checkpoints (each would be global): every
    sample once and one consensus, never four node-level averages in a row, a global one at each epoch's
    end, and the bytes each host sent show where each level went. A global
    average carries at least a whole model's partial sums across the link each way (gloo's ring: 1.5
    models a host), a node average none: each host's ``eth0`` carried at least G models and fewer than
    G + N (had the N node averages crossed, at least that many), its loopback at least N."""
    agents, traffic = torchrun_on_two_hosts(
        tmp_path, "--every", "4", "--ranks-per-node", "2", "--width", "20000", "--anchor", "1",
        "--checkpoint-every", "1000",
    )  # fmt: skip
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-4000:]
    ranks = results(tmp_path, "final", attempt=0)
    assert all(rank["boundaries"] == ranks[0]["boundaries"] for rank in ranks) and len(ranks[0]["boundaries"]) > 4
    assert len({rank["global_step"] for rank in ranks}) == 1
    for epoch in range(2):
        report = coverage_report(ranks, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    levels = [level for *_, level in ranks[0]["boundaries"]]
    global_level, node_level = levels.count("global"), levels.count("node")
    assert global_level + node_level == len(levels) and node_level >= global_level >= 2, levels
    since_global = 0
    for index, (epoch, *_, level) in enumerate(ranks[0]["boundaries"]):
        since_global = 0 if level == "global" else since_global + 1
        assert since_global < 4, f"boundary {index}: four node-level boundaries in a row: {levels}"
        if index + 1 == len(levels) or ranks[0]["boundaries"][index + 1][0] != epoch:
            assert level == "global", f"epoch {epoch} ends without a global average: {levels}"
    model = ranks[0]["parameter_bytes"]
    for host, sent in enumerate(traffic):
        across, inside = sent["eth0"] / model, sent["lo"] / model
        assert global_level <= across < global_level + node_level, (host, sent, levels)
        assert inside >= node_level, (host, sent, levels)


@pytest.mark.timeout(400)
def test_torchrun_restarts_both_hosts_workers_after_a_kill_and_resumes_with_exact_coverage(tmp_path):
    """Rank 1 (on host 0) is SIGKILLed in the first attempt, after the first checkpoint: both agents
    restart their workers, which resume from last.ckpt; with what the first attempt checkpointed,
    every sample of both epochs is trained once."""
    agents, _ = torchrun_on_two_hosts(tmp_path, "--kill", restarts=1)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-4000:]
    assert any("exitcode  : -9" in agent.stderr or "exitcode: -9" in agent.stderr for agent in agents)
    checkpointed, resumed = results(tmp_path, "at_checkpoint", 0), results(tmp_path, "final", 1)
    assert checkpointed[0]["global_step"] > 0
    for epoch in range(2):
        report = coverage_report(checkpointed + resumed, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


# --------------------------------------------------------------------------- the link model

# Two gloo ranks all-reduce 4 MB three times; rank 0 prints the fastest, in ms.
ALL_REDUCE = (
    "import sys, time, torch, torch.distributed as dist\n"
    "rank, address = int(sys.argv[1]), sys.argv[2]\n"
    "dist.init_process_group('gloo', init_method=f'tcp://{address}:29631', rank=rank, world_size=2)\n"
    "tensor, times = torch.ones(1_000_000), []\n"
    "for _ in range(3):\n"
    "    dist.barrier(); started = time.perf_counter(); dist.all_reduce(tensor)\n"
    "    times.append((time.perf_counter() - started) * 1000)\n"
    "print(min(times)) if rank == 0 else None\n"
    "dist.destroy_process_group()\n"
)


@pytest.mark.timeout(120)
def test_an_all_reduce_across_the_real_link_takes_at_least_what_the_link_model_allows():
    """The controller's and the simulator's link model (cohort/link.py) against a real 100 Mbit/s link:
    a 4 MB all-reduce of two ranks there takes at least what the limiter lets through, the tensor's
    bytes in TCP's frames (1514 bytes, which ``tbf`` counts, for each 1448) less the limiter's bucket.
    That floor is 95 % of the model's time (which also counts a line's checksum, preamble and gap, and
    the other direction's ACKs); a loaded machine can only make the transfer longer."""
    with Rig(hosts=2, rate_mbit=LINK_MBIT) as rig:
        ranks = [host.start([sys.executable, "-c", ALL_REDUCE, str(host.index), rig.hosts[0].address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for host in rig.hosts]
        try:
            finished = wait_all(ranks, 100, what="two ranks all-reducing across the rig")
        finally:
            for rank in ranks:
                kill_group(rank)
        bucket_bytes = rig.burst_kb * 1024
    assert [rank.returncode for rank in finished] == [0, 0], finished[0].stderr[-3000:]
    sent = 4_000_000  # what each rank sends: 2 (W - 1) / W of the 4 MB tensor, all of it for two
    floor_ms = (sent * 1514 / SEGMENT_PAYLOAD_BYTES - bucket_bytes) * 8 / (LINK_MBIT * 1000)
    model_ms = link_ms(4_000_000, 2, LINK_MBIT, 0.0)
    assert floor_ms > 0.95 * model_ms
    assert float(finished[0].stdout) >= floor_ms, (finished[0].stdout, floor_ms, model_ms)


@pytest.mark.timeout(420)
def test_the_slow_link_benchmark_sets_a_real_link_beside_the_simulated_one(tmp_path):
    """``benchmarks/slow_link.py --smoke --real-link``: each configuration on SlowLink and across the rig's
    real 100 Mbit/s link, the comparison in its results and its table; the link's measured goodput is
    the limiter's (a TCP transfer can only be slowed by a loaded machine, never sped past the rate)."""
    out = tmp_path / "slow_link.json"
    proc = run_python([str(REPO / "benchmarks" / "slow_link.py"), "--smoke", "--real-link", "--json", str(out)], REPO,
                      400, what="benchmarks/slow_link.py --smoke --real-link")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    record = json.loads(out.read_text())
    entry = record["results"]["mlp 100"]
    assert 0 < entry["goodput_mbit_s"] < 101, entry["goodput_mbit_s"]
    assert set(entry["real_link"]) == {"ddp", "elche-sync"}
    elche = entry["real_link"]["elche-sync"]  # a boundary every step (4 a rank) whatever the load
    assert elche["real_boundary_ms"]["median"] > 0 and elche["model_link_ms"]["median"] > 0, elche
    assert "mlp 100 Mbit/s real link" in proc.stdout and "| elche-sync | " in proc.stdout


# --------------------------------------------------------------------------- the elastic launcher

ELASTIC_PORT = 29500
# what a launcher waits for the store to answer before it takes itself cut off (default 30 s): the cohort's own
# timeout here, which its ranks' store reads already live with on a loaded machine
STORE_TIMEOUT_S = 10


def elastic_config(tmp_path: Path, nodes: int, **overrides: object) -> ScenarioConfig:
    """One rank per host, a slow step so that a partition lands mid-fit, the elastic cohort's timeout
    at 10 s (what survivors wait for a silent rank, and what a member cut off waits for the store)."""
    return ScenarioConfig.from_dict({
        "out": str(tmp_path), "epochs": 2, "samples": 384, "batch_size": 8, "devices": 1, "step_sleep_ms": 30,
        "trainer": {"num_nodes": nodes}, "elche": {"elastic": True, "timeout": 10, "anchor": 4}, **overrides,
    })  # fmt: skip


def elastic_launch(host, head, config: ScenarioConfig, *launcher_options: str) -> subprocess.Popen:
    """docs/elastic.md's several-machine command on ``host``, the store on ``head``: one launcher per
    host, ``launcher_options`` its own (``--nnodes 2 --node-rank 1 --nproc-per-node 1``, or ``--join``)."""
    return host.start(
        [sys.executable, "-m", "lightning_elche.launch", *launcher_options,
         "--rdzv-endpoint", f"{head.address}:{ELASTIC_PORT}", "--exit-grace", "10",
         "--store-timeout", str(STORE_TIMEOUT_S), str(SCENARIO), config.to_json()],
        cwd=config.out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def node_launch(host, nnodes: int) -> list[str]:
    return ["--nnodes", str(nnodes), "--node-rank", str(host.index), "--nproc-per-node", "1"]


def partition_mid_fit(config: ScenarioConfig, hosts: int, cut: int) -> list[subprocess.CompletedProcess]:
    """``hosts`` launchers, one rank each, the store on host 0; once every rank has passed a boundary,
    host ``cut``'s link goes down. Returns the launchers, in host order, once all have exited."""
    out = Path(config.out)
    with Rig(hosts=hosts, rate_mbit=LINK_MBIT) as rig:
        launchers = [elastic_launch(host, rig.hosts[0], config, *node_launch(host, hosts)) for host in rig.hosts]
        try:
            passed = [out / f"member{member}_at_boundary.json" for member in range(hosts)]
            try:
                wait_until(lambda: all(path.exists() for path in passed), "every rank past a boundary", 150, 0.05)
            except pytest.fail.Exception as failure:  # say where each launcher was (once seen in a loaded run)
                for launcher in launchers:
                    kill_group(launcher)
                said = [f"host {i}: exit {l.wait()}\n{l.communicate()[1][-3000:]}" for i, l in enumerate(launchers)]
                pytest.fail(f"{failure}; members past a boundary: {[p.exists() for p in passed]}\n" + "\n".join(said))
            rig.hosts[cut].link_down()
            return wait_all(launchers, 200, what=f"elastic launchers on {hosts} hosts with host {cut} partitioned")
        finally:
            for launcher in launchers:
                kill_group(launcher)


def assert_survivors_cover_the_fit(config: ScenarioConfig, survivors: int, lost_members: list[int]) -> None:
    """The survivors (ranks 0.. of the last generation) end on one consensus, and with what the lost
    members had in it every sample of every epoch was trained once."""
    out = Path(config.out)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(survivors)]
    assert len({result["final_digest"] for result in results}) == 1
    assert all(result["exception"] is None for result in results), [result["exception_message"] for result in results]
    lost = [{"trained": in_the_consensus(out, member, results[0]["boundaries"])} for member in lost_members]
    for epoch in range(config.epochs):
        report = coverage_report([*results, *lost], config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


def in_the_consensus(out: Path, member: int, boundaries: list[dict]) -> dict[str, list[int]]:
    """What lost ``member`` (rank ``member`` of the first generation, one rank per host) trained that the
    consensus holds, per epoch: all it trained by the last boundary the survivors committed with it
    (``boundaries``, a survivor's records; those before the first membership change are the first
    generation's). That is its record of the last boundary it saw commit, and the batches of any later
    one it voted on but never heard the decision of, cut off just after its vote (its results file,
    written as it failed, has them)."""
    seen = json.loads((out / f"member{member}_at_boundary.json").read_text())
    with_it = next((i for i, b in enumerate(boundaries) if b["level"].startswith("membership")), len(boundaries))
    trained = {epoch: list(indices) for epoch, indices in seen["trained"].items()}
    if with_it > seen["boundaries"]:
        own = json.loads((out / f"rank{member}.json").read_text())
        assert own["rank"] == member and own["exception"] is not None, own["exception_message"]
        batch = sum(b["steps"][member] for b in boundaries[: seen["boundaries"]])
        assert sum(map(len, own["step_batches"][:batch])) == sum(map(len, seen["trained"].values()))  # the same steps
        for record in boundaries[seen["boundaries"]:with_it]:
            for indices in own["step_batches"][batch : batch + record["steps"][member]]:
                trained.setdefault(str(record["epoch"]), []).extend(indices)
            batch += record["steps"][member]
    return trained


def assert_cut_off(launch: subprocess.CompletedProcess) -> None:
    """A host cut off from the store: its rank fails with an error naming the store and the partition,
    and its launcher, finding the store silent too, fails (its rank's output is the launcher's)."""
    assert launch.returncode != 0, launch.stderr[-4000:]
    assert "CohortFailure" in launch.stderr, launch.stderr[-4000:]
    assert "this machine is cut off from it by a network partition" in launch.stderr, launch.stderr[-4000:]
    # its launcher's read of the store times out, or fails at once if the partition reset the connection
    lost = f"did not answer within {STORE_TIMEOUT_S} s" in launch.stderr or "(the connection to the rendezvous store at" in launch.stderr
    assert lost and "the launch fails" in launch.stderr, launch.stderr[-4000:]


@pytest.mark.timeout(300)
def test_two_hosts_partitioned_the_store_side_trains_on_and_the_other_exits_with_an_error(tmp_path):
    """Two hosts, the store on host 0; host 1's link goes down mid-fit. Host 0's rank goes on alone after
    the timeout and finishes the fit; host 1's rank and launcher, cut off from the store, exit with an
    error naming it instead of hanging. (With two hosts, which end's link fails makes no difference: the
    side that holds the store is the one that goes on.)"""
    config = elastic_config(tmp_path, 2)
    store_side, cut_off = partition_mid_fit(config, hosts=2, cut=1)
    assert store_side.returncode == 0, store_side.stderr[-4000:]
    assert_cut_off(cut_off)
    assert_survivors_cover_the_fit(config, survivors=1, lost_members=[1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut", [2, 0], ids=["a-host-without-the-store", "the-store-host"])
def test_three_hosts_one_partitioned_the_side_with_the_store_trains_on(tmp_path, cut):
    """Three hosts, one rank each, the store on host 0. Host 2 cut off: hosts 0 and 1 go on after the
    timeout and finish identical with every sample once (the lost window aside); host 2's launcher fails
    naming the lost store. Host 0 cut off: hosts 1 and 2, though a majority and still joined, cannot
    reach the store that every agreement goes through, so both fail naming it, and host 0's rank
    trains the fit to its end alone: a partition never leaves two cohorts training apart."""
    config = elastic_config(tmp_path, 3)
    launches = partition_mid_fit(config, hosts=3, cut=cut)
    store_side = [0, 1] if cut == 2 else [0]
    for index, launch in enumerate(launches):
        if index in store_side:
            assert launch.returncode == 0, launch.stderr[-4000:]
        else:
            assert_cut_off(launch)
    assert_survivors_cover_the_fit(config, len(store_side), lost_members=[m for m in range(3) if m not in store_side])


@pytest.mark.timeout(300)
def test_a_host_joins_a_running_fit_from_another_machine(tmp_path):
    """Host 0 starts a two-rank fit and hosts the store; host 1 runs docs/elastic.md's joining command
    (``--nproc-per-node 1 --join --rdzv-endpoint A:29500``). The joiner is let in at a boundary, receives
    the members' state across the link and trains from there: three ranks end on one consensus, every
    sample of every epoch trained once."""
    config = elastic_config(tmp_path, 1, devices=2, epochs=4, samples=768, step_sleep_ms=120, slow={"1": 2.0})
    with Rig(hosts=2, rate_mbit=LINK_MBIT) as rig:
        head, joining = rig.hosts
        launchers = [elastic_launch(head, head, config, "--nproc-per-node", "2")]
        try:
            launchers.append(elastic_launch(joining, head, config, "--nproc-per-node", "1", "--join"))
            finished = wait_all(launchers, 240, what="a two-rank fit on host 0 and a rank of host 1 joining it")
        finally:
            for launcher in launchers:
                kill_group(launcher)
    for launch in finished:
        assert launch.returncode == 0, launch.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert len({result["final_digest"] for result in results}) == 1
    assert sum(len(trained) for trained in results[2]["trained"].values()) >= 0.05 * config.samples * config.epochs
    for epoch in range(config.epochs):
        report = coverage_report(results, config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    assert "joined the cohort" in "".join(launch.stderr for launch in finished)


@pytest.mark.timeout(300)
def test_a_spare_on_another_machine_takes_the_place_of_a_rank_killed_there(tmp_path):
    """docs/elastic.md's spares across machines: two hosts launch a fit of one rank each, host 1 with
    ``--replace --spares 1``. Host 1's rank is SIGKILLed mid-epoch; host 0's rank goes on alone, the spare
    host 1's launcher started once both ranks had trained takes the open place (it is admitted at a
    boundary, receiving the state across the link), and a new spare is held for the next loss. Two ranks
    end on one consensus; with the lost rank's last boundary, every sample of every epoch trained once."""
    config = elastic_config(tmp_path, 2, epochs=4, samples=768, step_sleep_ms=120,
                            kill_at={"rank": 1, "epoch": 0, "batch": 4})  # fmt: skip
    with Rig(hosts=2, rate_mbit=LINK_MBIT) as rig:
        head, other = rig.hosts
        launchers = [elastic_launch(head, head, config, *node_launch(head, 2)),
                     elastic_launch(other, head, config, *node_launch(other, 2), "--replace", "--spares", "1")]
        try:
            store_side, spare_side = wait_all(launchers, 240, what="two hosts, a spare on host 1 taking a lost rank's place")
        finally:
            for launcher in launchers:
                kill_group(launcher)
    assert store_side.returncode == 0 and spare_side.returncode == 0, spare_side.stderr[-4000:]
    said = launcher_notes(spare_side.stderr)
    lost = said.index("member 1 exited with -9; a spare takes its place")
    assert "spare member 2 starts on local rank 0" in said[:lost], said  # held since both ranks trained
    assert said[lost + 1 :] == ["spare member 3 starts on local rank 0"], said  # the next one, once member 2 trained
    assert "ElChe: spare member 3 was not needed: the fit is over" in spare_side.stderr
    assert_survivors_cover_the_fit(config, survivors=2, lost_members=[1])
