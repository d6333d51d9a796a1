"""Elastic cohorts: a rank lost mid-window leaves, the others finish the fit, every sample trained once.

Each fit runs under ``python -m lightning_elche.launch`` (the rendezvous store in the launcher, each
rank a process of its own). The lost rank's consensus is what it had at its last boundary: the
scenario leaves that in ``member<id>_at_boundary.json``, and the survivors' records cover the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    SCENARIO, assert_exact_coverage, boundary_sequence, coverage_report, kill_group, launch_two_nodes, launcher_notes, load_results, run_command,
    start, wait_all,
)
from saved_checkpoints import part_paths, saved_optimizer_states
from scenario_config import ScenarioConfig

from lightning_elche import ElCheStrategy, OuterNesterov
from lightning_elche.comm.rendezvous import free_port

# About 30 s of sleeping steps (slow steps, not a wait): a joiner (imports, Lightning's set-up) has the CPU
# to start and join early on.
LONG_ENOUGH_TO_JOIN = {"epochs": 4, "samples": 768, "step_sleep_ms": 120}
ELASTIC = {"epochs": 2, "samples": 384, "batch_size": 8, "devices": 3, "elche": {"elastic": True, "timeout": 10, "anchor": 4}}


def launch_elastic(tmp_path, *launch_options: str, launch_timeout_s: float = 150, **config):
    scenario = ScenarioConfig.from_dict({"out": str(tmp_path / "out"), **ELASTIC, **config})
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc", str(scenario.devices), "--exit-grace", "10",
               *launch_options, str(SCENARIO), scenario.to_json()]
    return run_command(command, tmp_path, launch_timeout_s, what=f"elastic launch (config {scenario.to_json()})"), scenario


def run_elastic(tmp_path, *launch_options: str, **config):
    proc, config = launch_elastic(tmp_path, *launch_options, **config)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc, config


def assert_every_sample_once(tmp_path, survivors, lost_members: int | tuple[int, ...], config) -> None:
    """Every sample of every epoch once across the survivors and what the lost members' consensus held."""
    members = (lost_members,) if isinstance(lost_members, int) else lost_members
    lost = [json.loads((tmp_path / "out" / f"member{m}_at_boundary.json").read_text()) for m in members]
    for epoch in range(config.epochs):
        report = coverage_report([*survivors, *({"trained": m["trained"]} for m in lost)], config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


def first_epoch_checkpoint(tmp_path) -> tuple[dict, dict]:
    """Epoch 0's checkpoint (one is saved at each epoch's end) and the ElChe state in it."""
    checkpoints = sorted((tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    assert [path.name.split("-")[0] for path in checkpoints] == ["epoch=0", "epoch=1"], checkpoints
    first = torch.load(checkpoints[0], weights_only=True)
    return first, next(state for state in first["callbacks"].values() if "world_size" in state)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "victim, when",
    [(1, {"batch": 4}), (0, {"batch": 4}), (2, {"window": "last"}), (0, {"phase": "validation"}), (0, {"phase": "checkpoint"})],
    ids=["a-follower-is-killed", "the-leader-is-killed", "a-rank-is-killed-in-its-epochs-last-window",
         "the-leader-is-killed-as-validation-starts", "the-leader-is-killed-as-it-takes-the-epochs-checkpoint"],
)
def test_survivors_of_a_killed_rank_finish_the_fit_with_every_sample_once(tmp_path, victim, when):
    """The third case changes the membership at the epoch's last boundary: nothing of the epoch is left
    to re-plan, and the next epoch is Lightning's to start (not trained early under this epoch's number).
    In the fourth, the survivors find the loss in validation's ``sync_dist`` reduce, outside any boundary;
    in the last, waiting for the leader to write the epoch's checkpoint: they take it again and write it."""
    proc, config = run_elastic(
        tmp_path, slow={"1": 2.0}, kill_at={"rank": victim, "epoch": 0, **when},
        tensorboard=True, tensorboard_version=None,  # version_0, version_1...: the new leader must continue version_0
        checkpoint_monitor={"save_top_k": -1},  # a checkpoint at every epoch's end
    )
    survivors = load_results(tmp_path, 2, proc.stderr)
    assert survivors[0]["final_digest"] == survivors[1]["final_digest"]
    assert boundary_sequence(survivors[0]) == boundary_sequence(survivors[1])
    assert survivors[0]["global_step"] == survivors[1]["global_step"] == survivors[0]["boundaries"][-1]["cohort_step"]
    assert [r["rank"] for r in survivors] == [0, 1]
    assert_every_sample_once(tmp_path, survivors, victim, config)
    changes = [b for b in survivors[0]["boundaries"] if b["level"].startswith("membership")]
    assert [b["level"] for b in changes] == ["membership:1"]
    assert any(f"member(s) [{victim}] left the cohort" in w for w in survivors[0]["warnings"]), survivors[0]["warnings"]
    between = [w for w in survivors[0]["warnings"] if "between boundaries" in w]
    assert len(between) == (1 if "phase" in when else 0), survivors[0]["warnings"]
    assert sorted(path.name for path in (tmp_path / "out" / "tb").iterdir()) == ["version_0"]
    _, elche = first_epoch_checkpoint(tmp_path)
    assert elche["world_size"] == 2  # every case loses its member before epoch 0's checkpoint is written


# Named instants of a boundary where a member dies (issue 34): the fault hook SIGKILLs rank 1 right before
# the nth matching collective, or while it waits inside it (its peers enter once it is dead).
BOUNDARY_INSTANTS = {
    "inside-the-parameter-all-reduce": ({}, {"op": "all_reduce", "origin": "elche:averaging", "nth": 3, "when": "inside"}),
    "between-the-control-and-the-parameter-reduce": (
        {}, {"op": "all_reduce", "origin": "elche:averaging", "nth": 2, "when": "before"}),
    "async-between-the-control-and-the-background-parameter-reduce": (
        {"policy": "async"}, {"op": "all_reduce", "origin": "elche:overlap", "nth": 2, "when": "before"}),
    "int8-inside-the-exchange-of-chunks": (
        {"compression": "int8"}, {"op": "all_to_all_single", "origin": "elche:compressed", "nth": 2, "when": "inside"}),
    "int8-inside-the-gather-of-the-averaged-chunks": (
        {"compression": "int8"}, {"op": "all_gather_single", "origin": "elche:compressed", "nth": 2, "when": "inside"}),
}  # fmt: skip


@pytest.mark.timeout(200)
@pytest.mark.parametrize("instant", sorted(BOUNDARY_INSTANTS))
def test_survivors_finish_the_fit_when_a_member_dies_at_a_named_instant_of_a_boundary(tmp_path, instant):
    """The two survivors find the loss in the boundary's collective (or the next one), regroup, and finish
    the fit on one consensus with every sample once, the lost member's last window going back to the epoch."""
    elche, fault = BOUNDARY_INSTANTS[instant]
    proc, config = run_elastic(tmp_path, elche={**ELASTIC["elche"], **elche}, collective_fault={"rank": 1, **fault})
    fault_note = json.loads((tmp_path / "out" / "fault.json").read_text())
    assert fault["op"] in fault_note["what"], fault_note  # the member died where the case says
    survivors = load_results(tmp_path, 2, proc.stderr)
    assert survivors[0]["final_digest"] == survivors[1]["final_digest"]
    assert_every_sample_once(tmp_path, survivors, 1, config)
    assert any("member(s) [1] left the cohort" in w for w in survivors[0]["warnings"]), survivors[0]["warnings"]


HIERARCHY_INSTANTS = {  # node_sync_every=2 on two nodes of two ranks: node-level, global, node-level... boundaries
    "inside-the-node-level-reduce": {"op": "all_reduce", "origin": "elche:hierarchy", "nth": 2, "when": "inside"},
    "inside-the-cross-node-reduce": {"op": "all_reduce", "origin": "elche:averaging", "nth": 2, "when": "inside"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("instant", sorted(HIERARCHY_INSTANTS))
def test_survivors_finish_the_fit_when_a_member_dies_inside_a_stage_of_a_hierarchical_boundary(tmp_path, instant):
    """Two launchers (nodes) of two members, averaging inside each node at every boundary and across
    nodes at every second: member 1 dies inside one stage. The three survivors (node 0 now one rank) undo
    the boundary, regroup, redo it and finish the fit on one consensus, every sample once but the lost
    member's last window, and both levels of boundary go on."""
    fault = HIERARCHY_INSTANTS[instant]
    config = ScenarioConfig.from_dict({
        "out": str(tmp_path / "out"), "epochs": 2, "samples": 384, "batch_size": 8, "devices": 2,
        "elche": {"elastic": True, "timeout": 20, "anchor": 3, "node_sync_every": 2}, "trainer": {"num_nodes": 2},
        "collective_fault": {"rank": 1, **fault},
    })  # fmt: skip
    finished, _ = launch_two_nodes(tmp_path, config, join=False)
    stderr = "\n".join(proc.stderr for proc in finished)
    assert [proc.returncode for proc in finished] == [0, 0], stderr[-6000:]
    assert f"inside all_reduce #{fault['nth']}" in json.loads((tmp_path / "out" / "fault.json").read_text())["what"]
    survivors = load_results(tmp_path, 3, stderr)
    assert len({survivor["final_digest"] for survivor in survivors}) == 1
    assert_every_sample_once(tmp_path, survivors, 1, config)
    assert any("member(s) [1] left the cohort" in w for w in survivors[0]["warnings"]), survivors[0]["warnings"]
    after = [b["level"] for b in survivors[0]["boundaries"]][-6:]  # the new generation's boundaries
    assert {"node", "global"} <= set(after), after


SETUP_INSTANTS = {  # Lightning's barriers before the first window, in the order a fit meets them
    "pre-setup-before-the-fits-session": 1,  # _call_setup_hook's first barrier: the strategy has no session yet
    "resume-end-before-the-first-plan": 3,  # _CheckpointConnector.resume_end: a session, no epoch planned
    "run-stage-before-the-first-plan": 4,
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("instant", sorted(SETUP_INSTANTS))
def test_survivors_train_the_whole_fit_when_a_member_dies_in_lightnings_set_up(tmp_path, instant):
    """A member killed before the first window (found by the fault sweep, ``benchmarks/fault_sweep.py``: the
    survivors failed on an assertion): the survivors regroup in the barrier, run it again among themselves and
    train the whole fit, every sample once between them, on one consensus."""
    proc, config = run_elastic(tmp_path, collective_fault={
        "rank": 1, "op": "barrier", "origin": "strategies/ddp", "phase": "setup", "nth": SETUP_INSTANTS[instant]})
    assert "SIGKILL before barrier" in json.loads((tmp_path / "out" / "fault.json").read_text())["what"]
    survivors = load_results(tmp_path, 2, proc.stderr)
    assert survivors[0]["final_digest"] == survivors[1]["final_digest"]
    assert_exact_coverage(survivors, config.samples, config.epochs)  # nothing trained was lost
    left = [w for w in survivors[0]["warnings"] if "member(s) [1] left the cohort" in w]
    assert len(left) == 1, survivors[0]["warnings"]


@pytest.mark.timeout(200)
def test_a_member_lost_as_the_ranks_write_their_parts_leaves_a_checkpoint_of_the_survivors(tmp_path):
    """Rank 1 writes its part of epoch 0's checkpoint and dies before the ranks tell each other how their
    writes went: the others regroup inside Lightning's checkpoint, take it again among themselves, and
    write it; the parts of the first attempt are gone, those of the survivors' are the checkpoint's."""
    proc, config = run_elastic(tmp_path, checkpoint_monitor={"save_top_k": -1}, collective_fault={
        "rank": 1, "nth": 1, "op": "all_gather_object", "origin": "elche:groups", "when": "before",
    })
    survivors = load_results(tmp_path, 2, proc.stderr)
    assert survivors[0]["final_digest"] == survivors[1]["final_digest"]
    assert_every_sample_once(tmp_path, survivors, 1, config)
    assert any("member(s) [1] left the cohort" in w and "between boundaries" in w for w in survivors[0]["warnings"])
    first, elche = first_epoch_checkpoint(tmp_path)
    assert elche["world_size"] == 2 and elche["parts"]["world_size"] == 2
    checkpoint = sorted((tmp_path / "out" / "checkpoints").glob("epoch=0*.ckpt"))[0]
    assert sorted(p.name for p in part_paths(checkpoint)[0].parent.iterdir()) == [p.name for p in part_paths(checkpoint)]
    assert len(saved_optimizer_states(checkpoint)) == 2
    assert first["global_step"] == elche["cohort_steps_total"] // 2


@pytest.mark.timeout(200)
def test_a_launch_rank_slow_to_start_is_waited_for_not_dropped(tmp_path):
    """A launch's ranks start seconds apart on a loaded machine. One whose heartbeat has not started yet
    is starting, not lost: the first generation waits for it (up to the fit's timeout), and the fit
    trains on every rank. (Taken for lost after the heartbeat's 1.5 s probe, it was dropped, then waited
    in the first generation's group the others had left until the launcher closed the store.)"""
    proc, config = run_elastic(tmp_path, devices=2, late_start={"member": 1, "after_s": 3.0})
    results = load_results(tmp_path, 2, proc.stderr)
    assert results[0]["final_digest"] == results[1]["final_digest"]
    assert not [b for b in results[0]["boundaries"] if b["level"].startswith("membership")], "a member was dropped"
    assert all(result["trained"][str(epoch)] for result in results for epoch in range(config.epochs))
    for epoch in range(config.epochs):
        report = coverage_report(results, config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


@pytest.mark.timeout(200)
def test_a_stalled_rank_is_removed_after_the_timeout(tmp_path):
    proc, config = run_elastic(
        tmp_path, slow={"1": 2.0}, kill_at={"rank": 2, "epoch": 0, "batch": 4, "signal": "SIGSTOP"},
        elche={**ELASTIC["elche"], "timeout": 5},
    )
    survivors = load_results(tmp_path, 2, proc.stderr)
    assert survivors[0]["final_digest"] == survivors[1]["final_digest"]
    assert_every_sample_once(tmp_path, survivors, 2, config)
    assert "is still running after" in proc.stderr  # the launcher ended the stopped process after the fit


Launched = subprocess.CompletedProcess


def launch_with_a_joiner(tmp_path, what: str, **config) -> tuple[ScenarioConfig, Launched, Launched]:
    """A two-rank fit and a launcher of one rank joining it, both started at once (the joiner asks to join
    once it has imported everything, and is let in at a boundary): the config, the fit's launcher, the joiner's."""
    port = free_port("127.0.0.1")
    scenario_config = ScenarioConfig.from_dict(
        {"out": str(tmp_path / "out"), **ELASTIC, "devices": 2, **LONG_ENOUGH_TO_JOIN, **config}
    )
    launch = [sys.executable, "-m", "lightning_elche.launch", "--exit-grace", "10", "--rdzv", f"127.0.0.1:{port}"]
    scenario = [str(SCENARIO), scenario_config.to_json()]
    processes = []
    try:
        for ranks in (["--nproc", "2"], ["--nproc", "1", "--join"]):
            processes.append(start([*launch, *ranks, *scenario], cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))  # fmt: skip
        fit, joiner = wait_all(processes, 150, what=what)
    finally:
        for proc in processes:
            kill_group(proc)
    return scenario_config, fit, joiner


@pytest.mark.timeout(200)
def test_a_rank_joins_a_two_rank_fit_at_a_boundary_and_trains_from_there(tmp_path):
    config, *finished = launch_with_a_joiner(tmp_path, "a two-rank fit and a rank joining it", slow={"1": 2.0})
    stderr = "\n".join(proc.stderr for proc in finished)
    assert [proc.returncode for proc in finished] == [0, 0], stderr[-6000:]
    results = load_results(tmp_path, 3, stderr)
    assert len({r["final_digest"] for r in results}) == 1
    joined = results[2]
    assert sum(len(v) for v in joined["trained"].values()) >= 0.05 * config.samples * config.epochs
    for epoch in range(config.epochs):
        report = coverage_report(results, config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    assert "joined the cohort" in stderr


@pytest.mark.timeout(200)
def test_a_joiner_that_dies_as_it_is_admitted_leaves_the_members_training(tmp_path):
    """A joiner is SIGKILLed as rank 0 sends it the cohort's state: the members had agreed on a generation
    with it. They find it gone, regroup on their own and finish the fit on one consensus, every sample once."""
    config, fit, joiner = launch_with_a_joiner(tmp_path, "a two-rank fit and a joiner dying as it is admitted",
                                               joiner_dies_at_admission=True)  # fmt: skip
    assert (tmp_path / "out" / "died_at_admission").exists(), joiner.stderr[-4000:]
    assert fit.returncode == 0, fit.stderr[-6000:]
    assert joiner.returncode != 0  # its one rank was killed, and nobody replaces it
    results = load_results(tmp_path, 2, fit.stderr)
    assert results[0]["final_digest"] == results[1]["final_digest"]
    for epoch in range(config.epochs):
        report = coverage_report(results, config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    assert any("member(s) [2] left the cohort" in w for w in results[0]["warnings"]), results[0]["warnings"]


@pytest.mark.timeout(200)
def test_a_spare_that_dies_as_it_takes_a_place_is_followed_by_the_next_spare(tmp_path):
    """Rank 1 is killed; the spare that takes its place is SIGKILLed as it is admitted. The members regroup
    without it at the next boundary, and the launcher starts its next spare at once (none is on its way in),
    which takes the place open again if the fit lasts long enough. The fit ends on one consensus with every
    sample once (rank 1's last boundary counted), on two ranks or three."""
    proc, config = run_elastic(tmp_path, "--replace", "--spares", "1", **LONG_ENOUGH_TO_JOIN,
                               kill_at={"rank": 1, "epoch": 0, "batch": 4}, joiner_dies_at_admission=True)  # fmt: skip
    assert (tmp_path / "out" / "died_at_admission").exists(), proc.stderr[-4000:]
    said = launcher_notes(proc.stderr)
    assert said.count("member 1 exited with -9; a spare takes its place") == 1, said
    died = said.index("member 3 exited with -9; a spare takes its place")  # the spare, as it was admitted
    assert said[died + 1] == "spare member 4 starts on local rank 0", said  # its slot, at once
    world = len(list((tmp_path / "out").glob("rank*.json")))
    assert world in (2, 3), world
    results = load_results(tmp_path, world, proc.stderr)
    assert len({r["final_digest"] for r in results}) == 1
    assert_every_sample_once(tmp_path, results, 1, config)


@pytest.mark.timeout(200)
def test_a_member_lost_as_the_survivors_form_their_group_leaves_the_last_one_training(tmp_path):
    """Rank 2 is killed; as the two survivors form the next generation's group, member 1 dies too (after it
    said it was ready, before it joined the group's rendezvous). Member 0 finds it gone when that rendezvous
    times out, agrees on a generation of its own, and finishes the fit alone, every sample once."""
    proc, config = run_elastic(tmp_path, kill_at={"rank": 2, "epoch": 0, "batch": 4},
                               dies_joining_group={"member": 1, "nth": 2})  # fmt: skip
    assert "as it forms its process group #2" in json.loads((tmp_path / "out" / "fault.json").read_text())["what"]
    (survivor,) = load_results(tmp_path, 1, proc.stderr)
    assert_every_sample_once(tmp_path, [survivor], (1, 2), config)
    changes = [b["level"] for b in survivor["boundaries"] if b["level"].startswith("membership")]
    assert changes == ["membership:2"], changes  # one regroup, two lost: the generation formed without both


@pytest.mark.timeout(200)
def test_a_member_lost_as_the_survivors_redo_a_boundary_leaves_the_last_one_training(tmp_path):
    """Rank 2 is killed; the two survivors regroup and redo the boundary without it, and as they gather
    what each trained in the lost window (the redone boundary's first collective), member 1 dies too
    (the fault sweep's fit 6 at 244ef5e: a kill in the survivors' gathers, there the averager state's, and
    the fit stopped). Member 0 undoes the redo, redoes it once more alone from the same cohort, and finishes the
    fit, every sample once: both lost members' last windows go back to the epoch."""
    proc, config = run_elastic(tmp_path, kill_at={"rank": 2, "epoch": 0, "batch": 4}, collective_fault={
        "rank": 1, "op": "all_gather_object", "origin": "elche:groups", "nth": 1, "when": "before"})  # fmt: skip
    assert "all_gather_object" in json.loads((tmp_path / "out" / "fault.json").read_text())["what"]
    (survivor,) = load_results(tmp_path, 1, proc.stderr)
    assert_every_sample_once(tmp_path, [survivor], (1, 2), config)
    assert any("member(s) [1] left the cohort" in w for w in survivor["warnings"]), survivor["warnings"]


@pytest.mark.timeout(200)
def test_a_member_lost_as_a_joiners_generation_forms_leaves_the_joiner_and_the_other_training(tmp_path):
    """A joiner is let in; as the generation with it forms its group, member 1 dies. The others agree on one
    more generation without it: the joiner maps the state it receives from the generation it was taken in
    (before, it took it from the one before its own, and failed), and the two finish with every sample once."""
    config, fit, joiner = launch_with_a_joiner(tmp_path, "a joiner let in as a member dies forming their group",
                                               dies_joining_group={"member": 1, "nth": 2})  # fmt: skip
    assert "as it forms its process group #2" in json.loads((tmp_path / "out" / "fault.json").read_text())["what"]
    assert fit.returncode == 0 and joiner.returncode == 0, (fit.stderr + joiner.stderr)[-6000:]
    results = load_results(tmp_path, 2, fit.stderr + joiner.stderr)
    assert results[0]["final_digest"] == results[1]["final_digest"]
    assert_every_sample_once(tmp_path, results, 1, config)


def test_fixed_shares_per_rank_are_refused_for_a_cohort_whose_ranks_change():
    """The one setting incoherent with elastic=True by nature (docs/compatibility.md); every other composes."""
    with pytest.raises(ValueError, match=r"elastic=True\) cannot take `partition_ratios`=\[2.0, 1.0\]: they fix one share per rank"):
        ElCheStrategy(elastic=True, partition_ratios=[2, 1])
    for setting, value in (("node_sync_every", 2), ("compression", "int8"), ("fragments", 2), ("policy", "async"),
                           ("dispatch", "dynamic"), ("micro_batch_sizes", [8, 4]), ("outer_optimizer", OuterNesterov())):
        ElCheStrategy(elastic=True, **{setting: value})


def test_elastic_without_its_launcher_is_refused_with_how_to_launch(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ElCheStrategy(elastic=True), max_steps=1,
                         logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"python -m lightning_elche.launch --nproc N"):
        trainer.fit(BoringModel())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spares", [0, 1], ids=["replacing", "with-a-spare"])
def test_a_fit_whose_every_member_fails_ends_at_once_with_their_error(tmp_path, spares):
    """Every member raises the same error (user code): no member is left to admit anyone, so the launcher
    replaces nobody, tells the spare (or the joiner it started first) to stop waiting, and exits with it."""
    proc, _ = launch_elastic(tmp_path, "--replace", "--spares", str(spares), launch_timeout_s=120,
                             raise_at={"rank": "all", "batch": 0})  # before any boundary
    assert proc.returncode != 0
    assert "scenario: rank 0 fails in training_step at batch 0" in proc.stderr, proc.stderr[-3000:]
    assert "every member of the cohort exited with an error; the fit is over" in proc.stderr, proc.stderr[-3000:]
    assert "is still running after" not in proc.stderr  # whoever waited for a place stopped by itself


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spares", [0, 1], ids=["a-joiner-starts-after-the-failure", "a-spare-started-ahead-takes-its-place"])
def test_a_killed_rank_is_replaced_by_one_that_joins_and_the_fit_ends_on_three(tmp_path, spares):
    """``--replace``: the launcher starts a joiner in place of the killed rank (or, with ``--spares 1``,
    the spare it started at launch asks for the place, and a new spare starts); the survivors go on
    meanwhile, let it in at a boundary, and the three of them finish with every sample once."""
    proc, config = run_elastic(
        tmp_path, "--replace", "--spares", str(spares), **LONG_ENOUGH_TO_JOIN, kill_at={"rank": 1, "epoch": 0, "batch": 4}
    )
    if spares:  # members 0-2 at launch, spare 3 once they trained; spare 4 once spare 3 trained in member 1's place
        launcher = launcher_notes(proc.stderr)
        exit_line = launcher.index("member 1 exited with -9; a spare takes its place")
        assert "spare member 3 starts on local rank 0" in launcher, launcher
        assert launcher[exit_line + 1:] == ["spare member 4 starts on local rank 1"], launcher
        assert "ElChe: spare member 4 was not needed: the fit is over" in proc.stderr
    else:
        assert "member 1 exited with -9; member 3 replaces it on local rank 1" in proc.stderr
    results = load_results(tmp_path, 3, proc.stderr)
    assert len({r["final_digest"] for r in results}) == 1
    lost = json.loads((tmp_path / "out" / "member1_at_boundary.json").read_text())
    for epoch in range(config.epochs):
        report = coverage_report([*results, {"trained": lost["trained"]}], config.samples, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    levels = [b["level"] for b in results[0]["boundaries"] if b["level"] != "global"]
    assert levels == ["membership:1"]  # the shrink; the join is an ordinary boundary followed by generation 2
    assert len(results[0]["boundaries"][-1]["steps"]) == 3
