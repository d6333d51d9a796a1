"""Sharded checkpoints: each rank's own states in a part beside the checkpoint (docs/resume.md).

The file layer first, in this process (parts written, read back, refused when missing or of another
save, cleaned up); then real fits on real processes: Lightning's ModelCheckpoint removing parts with
its top k, ``save_last="link"`` and ``ckpt_path="last"``, the single-file format of earlier versions
still resuming exactly, a missing or foreign part refused on every rank before training, a part that
cannot be written stopping every rank with the last checkpoint whole, and ``strategy="ddp"`` reading
the weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_consensus, coverage_report, run_scenario
from saved_checkpoints import elche_state, part_paths, saved_optimizer_states

from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.lightning.checkpoint_parts import (
    PartsRecord,
    SavedParts,
    discard,
    keep_only,
    parts_folder,
    remove_parts,
    write_part,
)

CRASH_EXIT_CODE = 17
SAMPLES = 128  # 16 batches of 8: 8 DDP-equivalent steps an epoch on two ranks
ADAM = {"optimizer": "adam", "lr": 0.01, "record_optimizer_state": True}
# fixed equal shares, two steps a window: checkpoints every 4 DDP-equivalent steps are epoch=0-step=4, -8, ...
FIXED = {"anchor": 2, "max_anchor": 2, "partition_ratios": [1, 1]}
BASE = {"epochs": 2, "samples": SAMPLES, "batch_size": 8, "validate": False, "elche": FIXED, **ADAM}


def adam_state(value: float) -> list[dict[str, Any]]:
    return [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((4,), value)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}]  # fmt: skip


def saved(tmp_path: Path, world_size: int = 3, token: str = "abc123", averager: bool = False) -> SavedParts:
    """A checkpoint path whose parts ranks 1 .. world_size - 1 wrote, as a save writes them."""
    checkpoint = str(tmp_path / "epoch=0-step=8.ckpt")
    record = PartsRecord(world_size, token, Path(parts_folder(checkpoint)).name)
    for rank in range(1, world_size):
        write_part(parts_folder(checkpoint), record, rank, adam_state(float(rank)),
                   {"error": torch.full((4,), 10.0 * rank)} if averager else {})  # fmt: skip
    return SavedParts(checkpoint, record, {"error": torch.zeros(4)} if averager else None, weights_only=True)


# --------------------------------------------------------------------------- the files, in this process


def test_each_part_is_read_back_as_its_rank_wrote_it_and_copied_out_of_the_file(tmp_path):
    parts = saved(tmp_path)
    parts.check()
    states = parts.optimizer_states(2)
    assert torch.equal(states[0]["state"][0]["exp_avg"], torch.full((4,), 2.0))
    path = Path(parts.folder) / "rank2-abc123.pt"
    path.write_bytes(b"replaced by the next save")  # the optimizer's copy does not depend on the file
    assert torch.equal(states[0]["state"][0]["exp_avg"], torch.full((4,), 2.0))
    assert parts.averager_states() is None  # the averager kept no state


def test_every_saved_ranks_averager_state_is_handed_over_rank_0s_from_the_checkpoint(tmp_path):
    states = saved(tmp_path, averager=True).averager_states()
    assert states is not None and [float(s["error"][0]) for s in states] == [0.0, 10.0, 20.0]


def test_a_missing_part_names_the_file_the_folder_and_what_to_do(tmp_path):
    parts = saved(tmp_path)
    (Path(parts.folder) / "rank1-abc123.pt").unlink()
    with pytest.raises(ValueError, match=r"its part of saved rank 1, .*rank1-abc123\.pt, is missing \(.* holds "
                                         r"\['rank2-abc123\.pt'\]") as info:
        parts.check()
    assert "the file and its folder epoch=0-step=8.ckpt.parts, to be copied together" in str(info.value)
    assert "Resume from another checkpoint" in str(info.value)
    shutil.rmtree(parts.folder)
    with pytest.raises(ValueError, match=r"epoch=0-step=8\.ckpt\.parts does not exist"):
        parts.check()


def test_the_parts_of_another_save_of_that_name_are_refused(tmp_path):
    saved(tmp_path, token="old")  # an earlier save of the same name
    parts = saved(tmp_path, token="new")
    (Path(parts.folder) / "rank2-new.pt").unlink()
    with pytest.raises(ValueError, match=r"holds \['rank1-new.pt', 'rank1-old.pt', 'rank2-old.pt'\]: parts of another save"):
        parts.check()
    os.replace(Path(parts.folder) / "rank2-old.pt", Path(parts.folder) / "rank2-new.pt")  # copied over by hand
    with pytest.raises(ValueError, match=r"rank2-new\.pt is not the part it records .*'token': 'old'.*the file was renamed"):
        parts.check()


def test_an_unreadable_part_is_called_truncated(tmp_path):
    parts = saved(tmp_path)
    path = Path(parts.folder) / "rank1-abc123.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"rank1-abc123\.pt cannot be read \(.*\): it is truncated or corrupted"):
        parts.check()


def test_a_symlinked_checkpoint_finds_the_parts_beside_the_file_it_points_to(tmp_path):
    """``ModelCheckpoint(save_last="link")``: last.ckpt is a link to the newest checkpoint."""
    parts = saved(tmp_path)
    Path(parts.checkpoint_path).write_bytes(b"")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "last.ckpt").symlink_to(parts.checkpoint_path)
    linked = SavedParts(str(tmp_path / "elsewhere" / "last.ckpt"), parts.record, None, weights_only=True)
    assert linked.folder == parts.folder
    linked.check()


def test_a_save_keeps_only_its_own_parts_a_failed_one_removes_only_its_own(tmp_path):
    older = saved(tmp_path, world_size=4, token="old")  # saved by 4 ranks, the folder's name saved again by 3
    newer = saved(tmp_path, world_size=3, token="new")
    folder = Path(newer.folder)
    discard(str(folder), newer.record)
    assert sorted(p.name for p in folder.iterdir()) == ["rank1-old.pt", "rank2-old.pt", "rank3-old.pt"]
    older.check()  # the last checkpoint of that name is whole
    newer = saved(tmp_path, world_size=3, token="new")
    (folder / "rank1-new.pt.unfinished").write_bytes(b"")  # a write cut short
    keep_only(str(folder), newer.record)
    assert sorted(p.name for p in folder.iterdir()) == ["rank1-new.pt", "rank2-new.pt"]
    keep_only(str(folder), PartsRecord(1, "alone", folder.name))  # saved again by one rank: no parts at all
    assert not folder.exists()
    saved(tmp_path)
    remove_parts(newer.checkpoint_path)
    assert not folder.exists()


def test_a_malformed_record_of_the_parts_is_refused():
    with pytest.raises(ValueError, match=r"record of the per-rank parts is malformed \(expected \['world_size', 'token', 'folder'\]"):
        PartsRecord.from_state({"world_size": 2})


def test_the_schema_says_where_the_per_rank_states_are():
    point = ResumePoint(epoch=0, num_samples=10, covered=ResumePoint.from_state(_minimal()).covered, seed=0,
                        world_size=2, cohort_steps_total=4, logged_steps_total=4, controller={})  # fmt: skip
    assert point.to_state()["schema_version"] == 3  # in parts (or nowhere: a checkpoint held in memory)
    point.optimizer_states = [adam_state(0.0), adam_state(1.0)]
    state = point.to_state()
    assert state["schema_version"] == 2  # the single file of earlier versions
    assert ResumePoint.from_state(state).optimizer_states_for(3) == point.optimizer_states[1]


def _minimal() -> dict[str, Any]:
    return {"schema_version": 2, "epoch": 0, "num_samples": 10, "covered": torch.tensor([[0, 4]]), "seed": 0,
            "world_size": 2, "cohort_steps_total": 4, "logged_steps_total": 4, "controller": {}}  # fmt: skip


# --------------------------------------------------------------------------- fits on real processes


@pytest.mark.timeout(300)
def test_model_checkpoint_removes_the_parts_of_what_it_drops_and_ddp_reads_the_weights(tmp_path):
    """save_top_k=1 at each epoch's end: epoch 0's checkpoint and its parts go when epoch 1's is written.
    The checkpoint stays a Lightning checkpoint: weights-only loadable, and strategy="ddp" resumes from it."""
    run_scenario(tmp_path / "elche", devices=3, checkpoint_monitor={"save_top_k": 1}, **{**BASE, "elche": {}})
    folder = tmp_path / "elche" / "out" / "checkpoints"
    (checkpoint,) = sorted(folder.glob("*.ckpt"))
    assert checkpoint.name.startswith("epoch=1")
    assert sorted(p.name for p in folder.iterdir()) == [checkpoint.name, checkpoint.name + ".parts"]
    assert sorted(part_paths(checkpoint)[0].parent.iterdir()) == part_paths(checkpoint)  # ranks 1 and 2's, no other
    content = torch.load(checkpoint, weights_only=True)
    assert "optimizer_states" not in content["callbacks"]["ElCheCallback"]  # rank 0 gathered nothing
    assert content["callbacks"]["ElCheCallback"]["parts"]["world_size"] == 3
    moments = [states[0]["state"][0]["exp_avg"] for states in saved_optimizer_states(checkpoint)]
    assert len(moments) == 3 and not torch.equal(moments[0], moments[1])  # each rank's own
    ddp = run_scenario(tmp_path / "ddp", strategy="ddp", ckpt_path=str(checkpoint), **{**BASE, "epochs": 3, "elche": {}})
    assert ddp[0]["boundaries"] == [] and ddp[0]["global_step"] > content["global_step"]


@pytest.mark.timeout(300)
def test_a_linked_last_checkpoint_resumes_with_ckpt_path_last(tmp_path):
    """ModelCheckpoint(save_last="link"): last.ckpt links to the newest step checkpoint, whose parts are
    beside it; the fit resumed with ckpt_path="last" (in the same folder) trains every sample once."""
    config = {**BASE, "checkpoint_every_n_steps": 4, "checkpoint_save_last": "link"}
    crashed = run_scenario(tmp_path, expect_failure=True, crash_after_checkpoints=2, **config)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = tmp_path / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(2)]
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and not (out / "checkpoints" / "last.ckpt.parts").exists()
    resumed = run_scenario(tmp_path, ckpt_path="last", **config)
    for epoch in range(2):
        report = coverage_report(snapshots + resumed, SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    assert_consensus(resumed, initial_step=snapshots[0]["global_step"])


@pytest.mark.timeout(400)
def test_a_single_file_checkpoint_of_earlier_versions_resumes_the_same_trajectory(tmp_path):
    """policy="sync", Adam, int8 boundaries: a checkpoint in the layout of earlier versions (every rank's
    optimizer state and error feedback gathered into the one file) resumes each rank's own states and ends
    where the uninterrupted run does; the resumed fit writes its own checkpoints in parts."""
    config = {**BASE, "checkpoint_every_n_steps": 4, "checkpoint_save_last": True,
              "elche": {"policy": "sync", "compression": "int8"}}  # fmt: skip
    whole = run_scenario(tmp_path / "whole", **config)
    crashed = run_scenario(tmp_path / "crashed", expect_failure=True, crash_after_checkpoints=3,
                           single_file_checkpoints=True, **config)  # fmt: skip
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    checkpoint = tmp_path / "crashed" / "out" / "checkpoints" / "last.ckpt"
    state = elche_state(checkpoint)
    assert state["schema_version"] == 2 and "parts" not in state and len(state["averager_states"]) == 2
    assert not list(checkpoint.parent.glob("*.parts"))
    resumed = run_scenario(tmp_path / "resumed", ckpt_path=str(checkpoint), **config)
    states = saved_optimizer_states(checkpoint)
    for result in resumed:
        exp_avg = states[result["rank"]][0]["state"][0]["exp_avg"]
        torch.testing.assert_close(torch.tensor(result["optimizer_state_at_start"]["0"]["exp_avg"]), exp_avg, rtol=0, atol=0)
    for got, expected in zip(resumed[0]["final"], whole[0]["final"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-6)
    assert elche_state(tmp_path / "resumed" / "out" / "checkpoints" / "last.ckpt")["schema_version"] == 3


@pytest.fixture(scope="module")
def step_checkpoints(tmp_path_factory) -> Path:
    """The folder of a two-rank fit's checkpoints at steps 4 and 8 (both kept)."""
    root = tmp_path_factory.mktemp("step_checkpoints")
    run_scenario(root, **{**BASE, "epochs": 1, "checkpoint_every_n_steps": 4})
    return root / "out" / "checkpoints"


@pytest.mark.timeout(200)
def test_a_missing_part_is_refused_on_every_rank_before_training(tmp_path, step_checkpoints):
    shutil.copy(step_checkpoints / "epoch=0-step=8.ckpt", tmp_path / "copied.ckpt")  # the file without its folder
    proc = run_scenario(tmp_path, expect_failure=True, ckpt_path=str(tmp_path / "copied.ckpt"), **BASE)
    assert proc.returncode != 0
    message = f"ElChe cannot resume from the checkpoint {tmp_path / 'copied.ckpt'}: its part of saved rank 1"
    assert proc.stderr.count(message) >= 2, proc.stderr[-4000:]
    assert "is missing" in proc.stderr and "its folder epoch=0-step=8.ckpt.parts, to be copied together" in proc.stderr


@pytest.mark.timeout(200)
def test_a_part_of_another_save_is_refused_on_every_rank_before_training(tmp_path, step_checkpoints):
    folder = tmp_path / "checkpoints"
    shutil.copytree(step_checkpoints, folder)
    (expected,) = part_paths(folder / "epoch=0-step=8.ckpt")
    (other,) = part_paths(folder / "epoch=0-step=4.ckpt")
    shutil.copy(other, expected)  # a part of another save, under this one's name
    proc = run_scenario(tmp_path, expect_failure=True, ckpt_path=str(folder / "epoch=0-step=8.ckpt"), **BASE)
    assert proc.returncode != 0
    assert proc.stderr.count(f"its part {expected} is not the part it records") >= 2, proc.stderr[-4000:]


@pytest.mark.timeout(300)
def test_a_part_that_cannot_be_written_stops_every_rank_and_the_last_checkpoint_resumes(tmp_path):
    """Rank 1 cannot write its part of the second checkpoint (a file stands where its folder goes): every
    rank stops with the same error naming rank 1 and the checkpoint before, which is whole and resumes."""
    folder = tmp_path / "failed" / "out" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "epoch=0-step=8.ckpt.parts").write_text("in the way")
    proc = run_scenario(tmp_path / "failed", expect_failure=True, **{**BASE, "epochs": 1, "checkpoint_every_n_steps": 4})
    assert proc.returncode != 0
    said = (f"CheckpointNotWritten: ElChe: rank(s) [1] could not write their part of the checkpoint "
            f"{folder / 'epoch=0-step=8.ckpt'} (rank 1: ")  # fmt: skip
    assert proc.stderr.count(said) >= 2, proc.stderr[-4000:]
    assert f"Last consensus checkpoint: {folder / 'epoch=0-step=4.ckpt'}" in proc.stderr
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0-step=4.ckpt"]  # the second was not written
    checkpoint = folder / "epoch=0-step=4.ckpt"
    covered = set(ResumePoint.from_state(elche_state(checkpoint)).covered_samples(shuffle=True).tolist())
    resumed = run_scenario(tmp_path / "resumed", ckpt_path=str(checkpoint), **{**BASE, "epochs": 1})
    assert sorted(i for result in resumed for i in result["trained"]["0"]) == sorted(set(range(SAMPLES)) - covered)
