"""policy="async": the parameter all-reduce overlaps the next window; consensus where Lightning needs it."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_exact_coverage, join_or_kill, local_steps, run_scenario
from torch import nn

from lightning_elche.cohort.control import LocalReport
from lightning_elche.comm import buffer as flat_buffer
from lightning_elche.comm.averaging import AveragingSpec, make_averager
from lightning_elche.comm.buffer import FlatBuffer, Fragment, merge_spans

ASYNC = {"epochs": 2, "samples": 512, "slow": {"1": 2.0}, "elche": {"policy": "async", "anchor": 3}, "step_work_ms": 2}


class Transposed(nn.Module):
    """A contiguous parameter and one that is not (a transposed view), as a model may hold."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Parameter(torch.arange(10.0))
        self.transposed = nn.Parameter(torch.arange(12.0).view(3, 4).t())


def test_the_late_correction_moves_each_parameter_by_alpha_times_average_minus_start(monkeypatch):
    """``FlatBuffer.move_params`` in chunks (3 values here) and in one piece where the parameter is not
    contiguous, leaving the region (a compressed averager's reference) as it was."""
    monkeypatch.setattr(flat_buffer, "DRIFT_CHUNK", 3)
    module = Transposed()
    assert not module.transposed.is_contiguous()
    buffer = FlatBuffer(module, torch.device("cpu"), rank=0, control_size=1)
    start = buffer.param_region.clone()
    with torch.no_grad():
        buffer.param_region.add_(torch.linspace(-1.0, 1.0, 22))  # the average
        module.plain.add_(100.0)  # local progress since the launch
    average = buffer.param_region.clone()
    expected = torch.cat([p.detach().reshape(-1) for p in module.parameters()]) + 0.5 * (average - start)
    divergence = buffer.move_params(start, [buffer.whole], alpha=0.5)
    assert torch.equal(buffer.param_region, average)
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in module.parameters()]), expected)
    assert divergence == pytest.approx(float((average - start).norm() / average.norm()))


def test_spans_inside_another_are_averaged_once():
    whole, first, second = Fragment(0, 3, 0, 30), Fragment(0, 1, 0, 10), Fragment(1, 3, 10, 30)
    assert merge_spans([whole, second]) == [whole]
    assert merge_spans([second, first]) == [first, second]
    assert merge_spans([]) == []


def _rank_main(rank: int, store_path: str, alpha: float, out: str) -> None:
    """Two ranks, parameters [r, r]; one overlapped boundary, local steps, then the next boundary."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    module = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(float(rank))
    overlapped = make_averager(
        module, rank=rank, world_size=2, device=torch.device("cpu"), group=None,
        spec=AveragingSpec(policy="async", easgd_alpha=alpha, ranks_per_node=2),
    )  # fmt: skip
    steps = 1 + rank  # rank 1 did twice the work (gamma 1): the average is (0*1 + 1*2) / 3
    overlapped.exchange(LocalReport(steps=steps), needs_consensus=lambda control: False)
    assert overlapped.overlap.in_flight
    with torch.no_grad():
        module.weight.add_(10.0 * (rank + 1))  # local training while the reduce runs
    result = overlapped.exchange(LocalReport(steps=1), needs_consensus=lambda control: True)
    Path(out, f"{rank}.txt").write_text(" ".join(f"{v:.6f}" for v in module.weight.view(-1).tolist()))
    Path(out, f"{rank}.div").write_text(f"{result.divergence:.6f}")
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_late_average_corrects_the_drift_and_keeps_local_progress(tmp_path, alpha):
    """After the overlapped boundary each rank holds theta_r + alpha * (average - theta_r at launch);
    the next boundary here is a consensus, so both then hold the same parameters."""
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_main, args=(r, str(tmp_path / "store"), alpha, str(tmp_path))) for r in (0, 1)]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 45, what="the two averaging ranks")
    assert [p.exitcode for p in ranks] == [0, 0]
    average = 2.0 / 3.0
    # before the consensus: rank r holds r + 10 (r + 1) + alpha (average - r); the consensus then
    # averages those with weight 1 each
    corrected = [r + 10.0 * (r + 1) + alpha * (average - r) for r in (0, 1)]
    consensus = sum(corrected) / 2
    for rank in (0, 1):
        values = [float(v) for v in (tmp_path / f"{rank}.txt").read_text().split()]
        assert values == pytest.approx([consensus, consensus], abs=1e-5)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    return run_scenario(tmp_path_factory.mktemp("async"), **ASYNC, checkpoint_every_n_steps=20)


@pytest.mark.timeout(200)
def test_async_trains_every_sample_once_and_agrees_where_lightning_looks(async_run):
    assert_exact_coverage(async_run, 512, 2)
    r0, r1 = async_run
    assert r0["global_step"] == r1["global_step"] == (local_steps(r0) + local_steps(r1)) // 2
    assert r0["final_digest"] == r1["final_digest"]  # the last boundary of an epoch is a consensus
    boundaries = r0["boundaries"]
    epoch_ends = [i for i, b in enumerate(boundaries) if i + 1 == len(boundaries) or boundaries[i + 1]["epoch"] != b["epoch"]]
    for index in epoch_ends:
        assert r0["digests"][index] == r1["digests"][index], f"boundary {index} closes an epoch without consensus"
    overlapped = [i for i in range(len(boundaries)) if r0["digests"][i] != r1["digests"][i]]
    assert len(overlapped) >= len(boundaries) // 2, "most boundaries should overlap their average"


@pytest.mark.timeout(200)
def test_async_checkpoints_are_taken_at_consensus_boundaries(async_run):
    """A boundary where ModelCheckpoint(every_n_train_steps) saves is a full, synchronous average."""
    r0, r1 = async_run
    assert r0["checkpoints"] == r1["checkpoints"] and r0["checkpoints"]
    saved_at = {int(name.split("step=")[1].split(".")[0]) for name in r0["checkpoints"]}
    for index, boundary in enumerate(r0["boundaries"]):
        if boundary["cohort_step"] in saved_at:
            assert r0["digests"][index] == r1["digests"][index], f"checkpoint at step {boundary['cohort_step']}"


@pytest.mark.timeout(200)
def test_async_issues_one_small_control_reduce_per_boundary_and_nothing_per_batch(async_run):
    for result in async_run:
        train = [c for c in result["calls"] if c["phase"] == "train"]
        boundary_batches = result["boundary_batches"]
        assert all([c["epoch"], c["batch"]] in boundary_batches for c in train)  # nothing inside a window
        averaging = Counter(
            (c["epoch"], c["batch"]) for c in train if c["origin"] in ("elche:control", "elche:overlap", "elche:averaging")
        )
        boundaries = Counter((epoch, batch) for epoch, batch in boundary_batches)  # a batch may close two windows
        # per boundary: the control reduce, then the launched or the consensus reduce
        assert averaging == Counter({at: 2 * count for at, count in boundaries.items()})
        controls = [[c["epoch"], c["batch"]] for c in train if c["origin"] == "elche:control"]
        assert controls == boundary_batches  # exactly one control reduce per boundary
    fast = async_run[0]  # twice as fast: its windows hold several batches that issue no collective at all
    assert len(fast["boundary_batches"]) < len(fast["step_batches"])
