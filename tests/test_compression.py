"""Compressed and streamed boundaries (issue: slow links): the codecs, error feedback on real gloo
ranks, the bytes on the wire, the simulated link, checkpoints of the error, and a Lightning fit.

The error-feedback identity the multi-process tests check: with constant shares ``s_r`` (equal
steps), every window's consensus moves by the decoded average, and what encoding rounded away is
kept and sent later, so after the last window (a consensus, every fragment averaged)

    consensus_T - consensus_0 + Σ_r s_r e_r + o  ==  Σ_t Σ_r s_r d_r^t

where ``d_r^t`` is what rank r's training moved in window t, ``e_r`` its error still held and
``o`` the chunk owners' errors. Exactly, up to float32 rounding: nothing is dropped.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_exact_coverage, join_or_kill, run_scenario
from torch import nn

from lightning_elche import ElCheStrategy, SlowLink
from lightning_elche.cohort.control import LocalReport
from lightning_elche.comm.averaging import FlatAverager, AveragingSpec, make_averager
from lightning_elche.comm.buffer import split_into_fragments
from lightning_elche.comm.compressed import CompressedAverager
from lightning_elche.comm.link import Wire
from lightning_elche.comm.quantize import BLOCK, COMPRESSIONS, Codec

WINDOWS = 6


def model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same parameters, as after Lightning's broadcast
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 96), nn.BatchNorm1d(96), nn.Linear(96, 64))


def averager_for(module: nn.Module, rank: int, world: int, compression, fragments: int, delay=None):
    return make_averager(
        module, rank=rank, world_size=world, device=torch.device("cpu"), group=None,
        spec=AveragingSpec(ranks_per_node=world, compression=compression, fragments=fragments, link_delay=delay),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the codecs


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_a_codec_returns_exactly_what_it_rounded_away(name):
    codec = Codec(name)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4 * BLOCK, generator=generator) * torch.logspace(-3, 2, 4 * BLOCK)  # blocks of very different scales
    values[7] = 0.0
    payload = torch.zeros(codec.payload_bytes(values.numel()), dtype=torch.uint8)
    error = torch.empty_like(values)
    codec.encode(values, payload, error)
    decoded = torch.empty_like(values)
    codec.decode(payload, decoded)
    assert torch.equal(error, values - decoded)
    bound = {"bf16": 2.0**-8, "int8": None, "fp8": 2.0**-3}[name]
    if bound is None:  # int8: at most half a step of the block's scale (absmax / 127), plus float32's
        # rounding of the quotient value / scale (up to 127, so 127 ulps of a step; 2 of 3,000 random
        # draws rounded a value just past the half step by 3.7e-6 of it when the slack was 1e-6)
        scale = values.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / 127
        slack = 4 * 127 * torch.finfo(torch.float32).eps
        assert (error.view(-1, BLOCK).abs() <= scale / 2 * (1 + slack)).all()
    else:  # floating codes: relative error, blocks scaled so none overflows (fp8's subnormals aside)
        big = values.abs() > values.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK) * 2.0**-6
        assert (error.abs()[big] <= values.abs()[big] * bound).all()
    assert decoded[7] == 0.0


def test_bytes_per_value():
    assert Codec("bf16").payload_bytes(1024) == 2048
    assert Codec("int8").payload_bytes(1024) == 1024 + 4 * 4 == Codec("fp8").payload_bytes(1024)
    with pytest.raises(ValueError, match="compression must be one of"):
        Codec("int4")


def test_fragments_are_runs_of_whole_tensors_of_about_equal_size():
    params = [torch.zeros(n) for n in (100, 10, 10, 80, 1, 99, 100)]
    fragments = split_into_fragments(params, 3)
    assert [(f.first_tensor, f.end_tensor) for f in fragments] == [(0, 3), (3, 6), (6, 7)]
    assert [f.size for f in fragments] == [120, 180, 100] and fragments[-1].end == 400
    assert len(split_into_fragments(params, 7)) == 7  # one tensor each
    with pytest.raises(ValueError, match="`fragments` must be at most the model's number of parameter tensors"):
        split_into_fragments(params, 8)


# ---------------------------------------------------------------------------- real gloo ranks


def _train_windows(rank: int, world: int, store: str, out: str, compression, fragments: int, nan_at: int) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the OpenMP pool the parent's checks started
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    module = model()
    averager = averager_for(module, rank, world, compression, fragments)
    buffer = averager.buffer if isinstance(averager, FlatAverager) else averager.flat.buffer
    start = buffer.param_region.clone()
    moved = torch.zeros_like(buffer.param_region)  # Σ_t d_r^t
    sent = []
    for window in range(WINDOWS):
        generator = torch.Generator().manual_seed(1000 * window + rank)
        with torch.no_grad():
            offset = 0
            for param in module.parameters():  # "training": each rank moves its own way
                step = torch.randn(param.numel(), generator=generator) * 0.01 * (1 + window)
                if window == nan_at and rank == 1:
                    step[0] = math.nan
                else:
                    moved[offset : offset + param.numel()] += step
                param.add_(step.view_as(param))
                offset += param.numel()
        last = window == WINDOWS - 1
        result = averager.exchange(LocalReport(steps=5), needs_consensus=lambda control: last)
        sent.append(result.sent_bytes)
    state = averager.state_dict() if isinstance(averager, CompressedAverager) else {}
    torch.save(
        {
            "start": start, "final": buffer.param_region.clone(), "moved": moved, "sent": sent,
            "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
            "state": state, "flat_bytes": buffer.nbytes,
        },
        Path(out) / f"{rank}.pt",
    )  # fmt: skip
    dist.destroy_process_group()
    os._exit(0)


def run_windows(tmp_path: Path, world: int, compression, fragments: int, nan_at: int = -1) -> list[dict]:
    out = tmp_path / f"{compression}_{fragments}_{world}"
    out.mkdir()
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_train_windows, args=(r, world, str(out / "store"), str(out), compression, fragments, nan_at))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 90, what=f"{world} ranks averaging with compression={compression}, fragments={fragments}")
    assert [p.exitcode for p in ranks] == [0] * world
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(world)]


def owner_errors(results: list[dict]) -> torch.Tensor:
    """Every chunk owner's error, at its place in the parameters."""
    total = torch.zeros_like(results[0]["final"])
    for result in results:
        for start, values in result["state"]["owner_error"]:
            total[start : start + values.numel()] += values
    return total


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("compression", "fragments", "world"),
    [("int8", 1, 2), ("fp8", 3, 2), ("bf16", 2, 3), (None, 3, 2)],
    ids=["int8", "fp8-3-fragments", "bf16-2-fragments-3-ranks", "exact-3-fragments"],
)
def test_error_feedback_sends_later_what_it_rounds_away(tmp_path, compression, fragments, world):
    results = run_windows(tmp_path, world, compression, fragments)
    final = results[0]["final"]
    for result in results:  # every rank decoded the same bytes: one consensus, bit for bit, in the model too
        assert torch.equal(result["final"], final) and torch.equal(result["params"], final)
    share = 1.0 / world  # equal steps
    expected = sum(share * r["moved"] for r in results)
    held = owner_errors(results) + sum(share * r["state"]["error"] for r in results) if compression else 0
    torch.testing.assert_close(final - results[0]["start"] + held, expected, rtol=0, atol=2e-6)
    if compression is not None:  # and something was held back: the codec did round
        assert results[0]["state"]["error"].abs().max() > 0


@pytest.mark.timeout(120)
def test_bytes_on_the_wire(tmp_path):
    """2 ranks: a full-precision boundary sends the float32 buffer once (2 (W-1)/W of it), int8 about a
    quarter of that; with 4 fragments a boundary sends one fragment, so a turn of four costs about
    one int8 boundary (the fragments are whole tensors, of unequal sizes here)."""
    flat = run_windows(tmp_path, 2, None, 1)  # fragments=1, no codec: the flat averager, unchanged
    assert set(flat[0]["sent"]) == {flat[0]["flat_bytes"]}
    int8 = run_windows(tmp_path, 2, "int8", 1)[0]["sent"]
    streamed = run_windows(tmp_path, 2, "int8", 4)[0]["sent"]
    full = flat[0]["flat_bytes"]
    assert all(0.24 * full < sent < 0.32 * full for sent in int8), (int8, full)
    assert max(streamed[:-1]) < int8[0] and sum(streamed[:4]) < 1.3 * int8[0], (streamed, int8)
    assert streamed[-1] >= int8[0]  # the last boundary is a consensus: every fragment


@pytest.mark.timeout(120)
def test_a_rank_that_is_not_finite_contributes_nothing_and_takes_the_consensus(tmp_path):
    results = run_windows(tmp_path, 2, "int8", 3, nan_at=2)
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert torch.isfinite(results[1]["params"]).all() and torch.isfinite(results[1]["state"]["error"]).all()


def _timed_boundary(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    module = nn.Linear(250, 100)  # 25,100 float32 values: a 100 kB buffer
    timings = []
    for delay in (None, SlowLink(mbit_s=8, latency_ms=20).seconds):
        averager = averager_for(module, rank, 2, None, 1, delay)
        started = time.perf_counter()
        result = averager.exchange(LocalReport(steps=1))
        timings.append((time.perf_counter() - started, result.sent_bytes))
    torch.save(timings, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.timeout(60)
def test_a_simulated_link_holds_each_collective_for_its_bytes(tmp_path):
    """8 Mbit/s and 20 ms: the ~100 kB boundary takes at least 20 ms + 100 kB * 8 / 8 Mbit/s = 120 ms more."""
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_timed_boundary, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 40, what="two ranks on a simulated link")
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank in (0, 1):
        (plain_s, plain_bytes), (slow_s, slow_bytes) = torch.load(tmp_path / f"{rank}.pt")
        assert plain_bytes == slow_bytes > 100_000
        assert slow_s >= 0.020 + slow_bytes * 8 / 8e6


# ---------------------------------------------------------------------------- checkpoints of the error


def _saved_states(world: int, fragments: int) -> tuple[list[dict], int]:
    """States as ``world`` ranks would have saved them, with recognisable errors."""
    states = []
    for rank in range(world):
        averager = averager_for(model(), rank, world, "int8", fragments)
        averager.cross.error.fill_(rank + 1)
        for error in averager.cross.owner_error:
            error.fill_(10 * (rank + 1))
        averager.cross.next_fragment = 1
        states.append(averager.state_dict())
    return states, averager.flat.buffer.param_region.numel()


def test_the_same_world_takes_its_own_error_back_exactly():
    states, _ = _saved_states(2, 2)
    resumed = averager_for(model(), 1, 2, "int8", 2)
    resumed.load_state_dicts(states)
    cross = resumed.cross
    assert torch.equal(cross.error, states[1]["error"]) and cross.next_fragment == 1
    assert all(bool((error[: len(v)] == 20).all()) for error, (_, v) in zip(cross.owner_error, states[1]["owner_error"]))


def test_another_world_keeps_the_sum_of_what_was_not_sent():
    """3 saved ranks resume as 2: rank 0 takes saved ranks 0 and 2, rank 1 saved rank 1, and both
    add every owner's error; so nothing any rank held back is lost."""
    states, size = _saved_states(3, 2)
    owners = torch.zeros(size)
    for state in states:
        for start, values in state["owner_error"]:
            owners[start : start + values.numel()] += values
    assert bool((owners > 0).all())  # the owners' chunks tile the parameters
    for rank, own in ((0, 1 + 3), (1, 2)):
        resumed = averager_for(model(), rank, 2, "int8", 2)
        resumed.load_state_dicts(states)
        torch.testing.assert_close(resumed.cross.error, own + owners)
        assert all(not error.any() for error in resumed.cross.owner_error)


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "int4"}, "`compression` must be None"),
        ({"fragments": 0}, "`fragments` must be an integer >= 1"),
        ({"link_mbit_s": -5}, "`link_mbit_s` must be None"),
        ({"simulated_link": 100}, "`simulated_link` must be None or a SlowLink"),
    ],
)
def test_bad_slow_link_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ElCheStrategy(**kwargs)


def test_a_simulated_link_is_what_the_controller_is_told_unless_the_user_says_otherwise():
    assert ElCheStrategy(simulated_link=SlowLink(100, 2)).settings.links.link_mbit_s == 100
    assert ElCheStrategy(simulated_link=SlowLink(100, 2)).settings.links.link_latency_ms == 2
    assert ElCheStrategy(simulated_link=SlowLink(100), link_mbit_s=1000).settings.links.link_mbit_s == 1000
    with pytest.raises(ValueError, match="`mbit_s` must be a positive number"):
        SlowLink(0)


def test_without_compression_nor_fragments_the_boundary_is_todays():
    averager = averager_for(model(), 0, 2, None, 1)
    assert type(averager) is FlatAverager and isinstance(averager.wire, Wire) and averager.wire.delay is None


# ---------------------------------------------------------------------------- a Lightning fit


@pytest.mark.timeout(300)
def test_a_fit_with_compressed_streamed_boundaries_trains_every_sample_once(tmp_path):
    """int8 and 2 fragments, a rank twice as slow: exact coverage, one model wherever Lightning looks
    (each epoch's last boundary), the other boundaries streamed, the bytes logged."""
    config = {
        "epochs": 2, "samples": 512, "slow": {"1": 2.0}, "step_work_ms": 2, "record_logs": True, "log_every_n_steps": 1,
        "elche": {"anchor": 3, "compression": "int8", "fragments": 2},
    }  # fmt: skip
    r0, r1 = run_scenario(tmp_path, **config)
    assert_exact_coverage([r0, r1], 512, 2)
    assert r0["final_digest"] == r1["final_digest"]
    boundaries = r0["boundaries"]
    epoch_ends = [i for i, b in enumerate(boundaries) if i + 1 == len(boundaries) or boundaries[i + 1]["epoch"] != b["epoch"]]
    assert all(r0["digests"][i] == r1["digests"][i] for i in epoch_ends)
    streamed = [i for i in range(len(boundaries)) if r0["digests"][i] != r1["digests"][i]]
    assert len(streamed) >= len(boundaries) // 3, "most boundaries average one fragment, the replicas differ elsewhere"
    assert ["elche/boundary_bytes", boundaries[0]["cohort_step"]] in r0["logged"]
