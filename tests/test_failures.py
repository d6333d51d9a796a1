"""Failures of one rank or of all: non-finite parameters, checkpoints asked for inside a window."""

from __future__ import annotations

import math

import pytest
from conftest import assert_consensus, load_results, run_scenario


@pytest.mark.timeout(200)
def test_a_non_finite_rank_is_left_out_and_reset_to_the_consensus(tmp_path):
    results = run_scenario(tmp_path, epochs=1, samples=256, slow={"1": 2.0}, nan_at=[{"rank": 1, "batch": 5}])
    assert_consensus(results)
    warnings = [w for result in results for w in result["warnings"]]
    assert len(warnings) == 1 and "rank(s) [1] had non-finite parameters at step" in warnings[0], warnings
    for result in results:
        assert all(math.isfinite(x) for tensor in result["final"] for x in _flat(tensor))


@pytest.mark.timeout(200)
def test_every_rank_non_finite_stops_with_the_last_consensus_kept(tmp_path):
    """Both ranks go NaN in the same window: a clear error on both, parameters back to the last consensus."""
    proc = run_scenario(
        tmp_path, expect_failure=True, epochs=1, samples=256, nan_at=[{"rank": 0, "batch": 2}, {"rank": 1, "batch": 2}]
    )
    assert proc.returncode != 0
    assert proc.stderr.count("every rank has non-finite parameters at step 2") >= 2, proc.stderr[-3000:]
    results = load_results(tmp_path, world=2, stderr=proc.stderr)
    for result in results:
        assert result["exception"] == "FloatingPointError"
        assert result["final_digest"] == result["digests"][-1]  # the consensus of the boundary before
        assert all(math.isfinite(x) for tensor in result["final"] for x in _flat(tensor))


@pytest.mark.timeout(200)
def test_a_checkpoint_inside_a_window_is_refused_on_every_rank(tmp_path):
    proc = run_scenario(
        tmp_path, expect_failure=True, epochs=1, samples=256, save_in_step=3, elche={"strict_collectives": False}
    )
    assert proc.returncode != 0
    assert proc.stderr.count("ElChe checkpoints are taken at window boundaries") >= 2, proc.stderr[-3000:]
    assert "every_n_train_steps" in proc.stderr


def _flat(value):
    if isinstance(value, list):
        for item in value:
            yield from _flat(item)
    else:
        yield value
