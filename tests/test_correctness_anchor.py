"""policy='sync' on equal ranks with plain SGD is DDP: a single-process reference, to 1e-5.

The reference runs in the test process: start from the scenario's initial parameters and, for
each optimizer step, average the gradients of the batches each rank trained at that step (as the
ranks recorded them), then take one SGD step. DDP does exactly this (mean of per-rank mean-loss
gradients); ElChe-sync averages the ranks' parameters after each local step instead, which is the
same update when the weights are equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import SYNC_SGD_CONFIG, assert_consensus, assert_exact_coverage, run_scenario  # noqa: E402
from scenario import IndexedDataset, make_model  # noqa: E402

STEPS = 20
TOLERANCE = 1e-5


def _reference(results: list[dict]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    config = SYNC_SGD_CONFIG
    dataset = IndexedDataset(config["samples"], seed=0)
    model = make_model("mlp")
    initial = [torch.tensor(t, dtype=torch.float32) for t in results[0]["initial"]]
    with torch.no_grad():
        for param, value in zip(model.parameters(), initial):
            assert param.shape == value.shape
            param.copy_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for result in results:
            indices = torch.tensor(result["step_batches"][step])
            x, y = dataset.x[indices], dataset.y[indices]
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            for acc, param in zip(grads, model.parameters()):
                acc += param.grad / len(results)
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        optimizer.step()
    return initial, [p.detach().clone() for p in model.parameters()]


def _check_equivalence(results: list[dict]) -> None:
    assert_consensus(results)
    assert_exact_coverage(results, SYNC_SGD_CONFIG["samples"], 1)
    for result in results:
        assert len(result["step_batches"]) == STEPS
        assert all(len(batch) == SYNC_SGD_CONFIG["batch_size"] for batch in result["step_batches"])
        assert result["initial"] == results[0]["initial"], "ranks started from different parameters"
        assert [b["counts"] for b in result["boundaries"]] == [[1, 1]] * STEPS
    initial, reference = _reference(results)
    # not vacuous: 20 SGD steps moved the parameters well beyond the tolerance
    moved = max(float((r - i).abs().max()) for r, i in zip(reference, initial))
    assert moved > 100 * TOLERANCE, f"the reference barely moved ({moved})"
    for result in results:
        final = [torch.tensor(t, dtype=torch.float32) for t in result["final"]]
        errors = [float((f - r).abs().max()) for f, r in zip(final, reference)]
        assert max(errors) <= TOLERANCE, f"rank {result['rank']}: max |elche - reference| per tensor {errors}"


@pytest.mark.timeout(200)
def test_sync_sgd_equals_single_process_reference_shuffled(sync_sgd_shuffled_run):
    _check_equivalence(sync_sgd_shuffled_run)
    # shuffled: the rank-0 batches are not simply the first indices in order
    assert sync_sgd_shuffled_run[0]["step_batches"][0] != list(range(8))


@pytest.mark.timeout(200)
def test_sync_sgd_equals_single_process_reference_shuffle_false(tmp_path, sync_sgd_shuffled_run):
    """DataLoader(shuffle=False), another seed: still DDP-equivalent.

    Lightning builds the train DistributedSampler with shuffle=True whatever the DataLoader says
    (``_process_dataloader``: ``is_shuffled = True`` for training), under DDP too, and ElChe takes
    the order from that sampler, so the order is the seeded permutation, not 0..N-1.
    """
    results = run_scenario(tmp_path, shuffle=False, seed=1, **SYNC_SGD_CONFIG)
    _check_equivalence(results)
    assert results[0]["initial"] != sync_sgd_shuffled_run[0]["initial"]
    order = [i for step in zip(*(r["step_batches"] for r in results)) for batch in step for i in batch]
    assert sorted(order) == list(range(SYNC_SGD_CONFIG["samples"]))
    assert results[0]["step_batches"] != sync_sgd_shuffled_run[0]["step_batches"], "seed 1 gave seed 0's order"


@pytest.mark.timeout(200)
def test_a_rank_with_half_the_micro_batch_trains_the_same_samples_to_the_same_parameters(tmp_path, sync_sgd_shuffled_run):
    """micro_batch_sizes=[8, 4]: rank 1 trains each step's 8 samples as two batches of 4 and
    accumulates them (Lightning scales each by 1/2), so under policy='sync' the run is the one with
    equal batches: the same samples in every step, the same parameters, the same boundaries."""
    elche = {**SYNC_SGD_CONFIG["elche"], "micro_batch_sizes": [8, 4]}
    results = run_scenario(tmp_path, shuffle=True, **{**SYNC_SGD_CONFIG, "elche": elche})
    assert_consensus(results, accumulate=[1, 2])
    assert_exact_coverage(results, SYNC_SGD_CONFIG["samples"], 1)
    equal = sync_sgd_shuffled_run
    assert results[0]["step_batches"] == equal[0]["step_batches"]
    halves = results[1]["step_batches"]
    assert [len(batch) for batch in halves] == [4] * 2 * STEPS, "rank 1 did not train batches of 4"
    assert [halves[2 * s] + halves[2 * s + 1] for s in range(STEPS)] == equal[1]["step_batches"]
    assert [b["counts"] for b in results[0]["boundaries"]] == [[1, 1]] * STEPS  # one optimizer step per 2 batches
    for micro, reference in zip(results, equal):
        for got, want in zip(micro["final"], reference["final"]):
            error = float((torch.tensor(got) - torch.tensor(want)).abs().max())
            assert error <= TOLERANCE, f"rank {micro['rank']}: |micro - equal batches| = {error}"
