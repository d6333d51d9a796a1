"""SLURM's requeue signal under ElChe, with the ranks started the way srun starts them.

Lightning handles SIGUSR1 (``#SBATCH --signal=USR1@90``, auto-requeue) by saving a checkpoint and
calling ``scontrol requeue`` from the signal handler, on each rank at its own moment: under ElChe
that would be mid-window. ElChe records the signal and runs Lightning's handler at the next
boundary on every rank. A stand-in ``scontrol`` on PATH records the requeue.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_consensus, load_results, run_srun_style

JOB_ID = "4242"


@pytest.mark.timeout(200)
def test_requeue_signal_on_one_rank_checkpoints_at_a_boundary_and_requeues_once(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    # Rank 1's batch 1 of epoch 0: every rank trains at least one step a window and an epoch opens with
    # two one-step probes, so the signal is sent whatever the shares (under load a starved rank 1 once
    # trained 4 batches of epoch 0 and never reached batch 6), and a boundary of epoch 0 follows it.
    config = {
        "epochs": 2, "samples": 512, "slow": {"1": 2.0},
        "sigterm_at": {"rank": 1, "epoch": 0, "batch": 1, "signal": "SIGUSR1"},
    }
    ranks = run_srun_style(tmp_path, 2, config, {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID})
    failed = {number: rank.stderr[-3000:] for number, rank in enumerate(ranks) if rank.returncode != 0}
    assert not failed, "\n".join(f"rank {number}:\n{stderr}" for number, stderr in failed.items())
    results = load_results(tmp_path, world=2)
    assert results[1]["sigterm_sent"] is not None, "rank 1 never reached its batch 1 of epoch 0: no signal was sent"
    assert_consensus(results)  # the signal did not stop training, and nothing diverged
    assert (tmp_path / "scontrol.log").read_text().split("\n")[:-1] == [f"requeue {JOB_ID}"]  # rank 0, once
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    state = checkpoint["callbacks"]["ElCheCallback"]
    assert state["epoch"] == 0 and checkpoint["global_step"] in [b["cohort_step"] for b in results[0]["boundaries"]]
