"""The collective invariant, traced on real processes: nothing is per batch.

``tests/scenario.py`` wraps every ``torch.distributed`` collective and records, per rank, the op,
the phase (setup / train / validation / epoch_end / teardown), the epoch and batch, and the code
that issued it. During training ElChe's only collective is the boundary all-reduce.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import assert_collectives_coherent, assert_consensus, collective_ops, run_scenario  # noqa: E402

SIGTERM_BROADCAST = "loops/training_epoch_loop:_broadcast_sigterm_tensor"


def _train_calls(result: dict) -> list[dict]:
    return [c for c in result["calls"] if c["phase"] == "train"]


@pytest.mark.timeout(200)
def test_elche_issues_only_boundary_collectives_while_training(slowed_run):
    assert_consensus(slowed_run)
    assert_collectives_coherent(slowed_run)
    for result in slowed_run:
        train = _train_calls(result)
        # without checkpoints or per-step logging, the boundary all-reduce is the only one:
        # once per boundary, far fewer than batches, and no broadcast at all
        assert {(c["op"], c["origin"]) for c in train} == {("all_reduce", "elche:averaging")}
        assert len(train) == len(result["boundaries"])
        assert len(train) < len(result["step_batches"])
        assert not [c for c in result["calls"] if c["op"] == "broadcast"], "a broadcast was issued"
    # the fast rank ran many more batches than there were boundaries
    reference = slowed_run[0]
    assert len(reference["step_batches"]) >= 2 * len(reference["boundaries"])


@pytest.mark.timeout(200)
def test_plain_ddp_broadcasts_every_batch_and_the_tracer_sees_it(tmp_path):
    """The contrast: with strategy='ddp' Lightning broadcasts a SIGTERM flag before every batch."""
    results = run_scenario(tmp_path, strategy="ddp", epochs=1, samples=256)
    for result in results:
        batches = len(result["step_batches"])
        assert batches == 256 // 8 // 2
        per_batch = [c for c in _train_calls(result) if c["origin"] == SIGTERM_BROADCAST]
        assert all(c["op"] == "broadcast" for c in per_batch)
        assert len(per_batch) >= batches, f"rank {result['rank']}: {len(per_batch)} broadcasts for {batches} batches"
        # one per batch: issued before each batch's hooks run, so the tracer labels it with the
        # previous batch's index (-1 before the first)
        assert [c["batch"] for c in per_batch] == list(range(-1, batches - 1))
    assert collective_ops(results[0]) == collective_ops(results[1])
