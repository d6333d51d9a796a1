"""The elche/ metrics, the progress bar (total, anchor, share) and the end-of-fit summary."""

from __future__ import annotations

import re

import pytest
from conftest import run_scenario

from lightning_elche.cohort.records import BoundaryRecord
from lightning_elche.lightning.telemetry import boundary_metrics, cohort_series, leader_series, logs_boundary, summary


def record(**overrides) -> BoundaryRecord:
    fields = dict(
        epoch=0, window=3, steps=[30, 10], samples=[240, 80], window_ms=[300.0, 250.0], boundary_ms=12.0, anchor=10,
        counts=[30, 10], cohort_step=57, divergence=0.01, cohort_divergence=0.02, cohort_divergence_mean=0.015,
        verdict="stable", previous_boundary_ms=[9.0, 4.0],
    )
    fields.update(overrides)
    return BoundaryRecord(**fields)


def test_boundary_metrics_from_one_record():
    metrics = boundary_metrics(record())
    assert metrics["elche/anchor"] == 10
    assert metrics["elche/boundary_ms"] == 4.0  # the cheapest rank's: the last to arrive waited for nobody
    assert metrics["elche/overhead"] == pytest.approx(4.0 / 304.0)
    assert metrics["elche/throughput"] == pytest.approx(320 / 0.304)
    assert metrics["elche/rank0/share"] + metrics["elche/rank1/share"] == pytest.approx(1.0)
    assert metrics["elche/rank0/step_ms"] == 10.0 and metrics["elche/rank1/step_ms"] == 25.0
    assert metrics["elche/rank0/idle"] == 0.0 and metrics["elche/rank1/idle"] == pytest.approx(50 / 300)
    # DDP: equal shares, every step waits for rank 1's 250 ms / 80 samples
    assert metrics["elche/ddp_estimate"] == pytest.approx(2 / (0.25 / 80))
    assert metrics["elche/speedup_vs_ddp"] == pytest.approx(metrics["elche/throughput"] / metrics["elche/ddp_estimate"])
    assert metrics["elche/divergence"] == 0.02


def test_the_series_callbacks_see_are_the_ones_every_rank_computes_alike():
    """The guard counts come from this rank's history (an elastic joiner's starts at its admission) and the
    bytes are what rank 0 sent: rank 0 logs them, callbacks cannot monitor them."""
    series = cohort_series(record(user_scalars={"seen": 320.0}))
    assert series["elche/user/seen"] == 320.0 and series["elche/anchor"] == 10
    assert not {"elche/guard/suppress", "elche/guard/nudge", "elche/boundary_bytes"} & set(series)
    history = [record(verdict="suppress"), record(verdict="stable"), record(verdict="nudge"), record(verdict="suppress")]
    assert leader_series(history, 4096) == {"elche/guard/suppress": 2.0, "elche/guard/nudge": 1.0, "elche/boundary_bytes": 4096.0}


@pytest.mark.parametrize(
    "before, after, every_n, stops, logged",
    [
        (0, 4, 5, False, False),  # no multiple of 5 in (0, 4]
        (4, 5, 5, False, True),  # the boundary reaches 5
        (3, 12, 5, False, True),  # it jumps over 5 and 10: one point
        (10, 14, 5, False, False),  # 10 was the boundary before's
        (10, 14, 5, True, True),  # the fit stops here: logged, as Lightning logs the batch it stops at
        (7, 7, 1, False, False),  # a boundary that did not move the step: its step already has a point
        (0, 100, 0, True, False),  # log_every_n_steps=0: nothing, as in Lightning
    ],
)
def test_a_boundary_is_logged_when_its_steps_pass_a_multiple_of_log_every_n_steps(before, after, every_n, stops, logged):
    assert logs_boundary(before, after, every_n, stops) is logged


def test_summary_table():
    text = summary([record(), record(cohort_step=70)], wall_s=12.5)
    assert text.startswith("ElChe summary: 12.5 s of training, 640 samples, 2 boundaries, final anchor 10")
    assert "estimated speedup vs DDP" in text
    assert "     0 | 75.0% | 100.0%" in text and "     1 | 25.0% | 83.3%" in text


def test_summary_table_covers_the_ranks_at_the_end_of_an_elastic_fit():
    """Members joined (no membership record: admission only adds ranks), then two were lost: the table is
    the last boundaries' ranks. (The sweep's fit 17 at 909e881 ended a member on an IndexError here.)"""
    one = record(steps=[30], samples=[240], window_ms=[300.0], counts=[30], previous_boundary_ms=[9.0])
    three = record(steps=[30, 10, 10], samples=[240, 80, 80], window_ms=[300.0, 250.0, 250.0], counts=[30, 10, 10],
                   previous_boundary_ms=[9.0, 4.0, 4.0])  # fmt: skip
    text = summary([record(level="membership:2"), three, one], wall_s=12.5)  # the old table's world: 3, then 1
    assert text.splitlines()[2:] == ["     0 | 100.0% | 100.0%"]
    text = summary([one, record(level="membership:2", steps=[1], samples=[8], window_ms=[1.0], counts=[1],
                                previous_boundary_ms=[1.0]), one, three, three], wall_s=12.5)  # fmt: skip
    assert "1 membership change(s)" in text and len(text.splitlines()[2:]) == 3
    assert "     0 | 60.0% | 100.0%" in text


def passed_multiples(boundaries: list[dict], every_n: int) -> list[int]:
    """The indices of the boundaries whose steps passed a multiple of ``every_n`` (the fit does not stop early)."""
    steps = [0] + [b["cohort_step"] for b in boundaries]
    return [i for i in range(len(boundaries)) if logs_boundary(steps[i], steps[i + 1], every_n, stops=False)]


@pytest.mark.timeout(200)
def test_tensorboard_event_files_hold_an_elche_point_per_boundary_that_passed_log_every_n_steps(tmp_path):
    """A real fit with a TensorBoardLogger and ``log_every_n_steps=5``; the event files are read back. Every
    rank's ``trainer.callback_metrics`` holds the last boundary's series, the same on every rank."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_scenario(
        tmp_path, epochs=2, samples=512, slow={"1": 2.0}, tensorboard=True, log_seen=True, progress_bar=True,
        log_every_n_steps=5, elche={"anchor": 4, "scalar_reductions": {"seen": "sum", "rank": "max"}},
    )
    boundaries = results[0]["boundaries"]
    logged = passed_multiples(boundaries, 5)
    assert 0 < len(logged) < len(boundaries), "the interval thinned nothing (or everything)"
    series = [{k: v for k, v in r["callback_metrics"].items() if k.startswith("elche/")} for r in results]
    assert series[0] == series[1] and series[0]["elche/anchor"] == boundaries[-1]["anchor"]
    assert series[0]["elche/user/seen"] == boundaries[-1]["user_scalars"]["seen"]
    assert not {"elche_share", "elche/boundary_bytes", "elche/guard/suppress"} & set(results[1]["callback_metrics"])
    [events_file] = (tmp_path / "out" / "tb").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("elche/anchor", "elche/overhead", "elche/throughput", "elche/rank0/share", "elche/rank1/idle"):
        assert tag in tags, sorted(t for t in tags if t.startswith("elche/"))
    anchor = events.Scalars("elche/anchor")
    assert [e.step for e in anchor] == [boundaries[i]["cohort_step"] for i in logged]
    assert [e.value for e in anchor] == [boundaries[i]["anchor"] for i in logged]
    shares = zip(events.Scalars("elche/rank0/share"), events.Scalars("elche/rank1/share"))
    assert all(abs(a.value + b.value - 1.0) < 1e-6 for a, b in shares)
    assert all(0.0 <= e.value <= 1.0 for e in events.Scalars("elche/rank1/idle"))
    assert all(e.value > 0 for e in events.Scalars("elche/throughput"))
    assert events.PluginTagToContent("custom_scalars"), "no custom-scalars layout was written"
    assert "ElChe summary:" in results[0]["output_tail"]
    tail = results[0]["output_tail"]
    assert re.search(r"elche_anchor=\d+\.\d+, elche_share=0\.\d+", tail), "no anchor and share in the progress bar"
    # the bar has a total again (ElChe's sampler has no length): each epoch ends at 100 %, on the exact count
    ends = re.findall(r"Epoch (\d+): 100%\|[^|]*\| (\d+)/(\d+)", tail)
    assert {epoch for epoch, _, _ in ends} == {"0", "1"}, ends
    assert all(done == total for _, done, total in ends), ends
    trained = [sum(b["steps"][0] for b in boundaries if b["epoch"] == epoch) for epoch in (0, 1)]
    assert {(int(epoch), int(total)) for epoch, _, total in ends} == set(enumerate(trained))
    # users' per-rank metrics rolled up across ranks at each boundary: every rank's samples so far
    seen = [sum(sum(b["samples"]) for b in boundaries[: index + 1]) for index in range(len(boundaries))]
    assert [b["user_scalars"]["seen"] for b in boundaries] == seen
    assert {b["user_scalars"]["rank"] for b in boundaries} == {1.0}
    assert [e.value for e in events.Scalars("elche/user/seen")] == [seen[i] for i in logged]


def throughput(boundary: dict) -> float:
    return cohort_series(BoundaryRecord(**boundary))["elche/throughput"]


@pytest.mark.timeout(200)
def test_a_step_checkpoint_monitoring_an_elche_series_keeps_the_same_files_on_every_rank(tmp_path):
    """ModelCheckpoint(monitor="elche/throughput", every_n_train_steps=6, save_top_k=2): ElChe lands a boundary
    on each multiple of 6 steps (planned dispatch, which "auto" picks for a fit with step checkpoints) and
    opens the checkpoint there, each ranked by its own throughput, every rank deciding alike (saved: those
    that made the top 2 when they opened)."""
    results = run_scenario(tmp_path, epochs=2, samples=512, slow={"1": 2.0}, elche={"anchor": 4}, checkpoint_monitor={
        "monitor": "elche/throughput", "mode": "max", "save_top_k": 2, "every_n_train_steps": 6})
    r0, r1 = results
    by_step = {b["cohort_step"]: b for b in r0["boundaries"]}
    saved = r0["saved_steps"]
    assert saved == r1["saved_steps"] and len(saved) > 2, (saved, r1["saved_steps"])
    # each on a multiple of 6 (those that made the top 2 when they opened), increasing
    assert all(step % 6 == 0 for step in saved) and saved == sorted(set(saved)), saved
    best = sorted(saved, key=lambda step: throughput(by_step[step]), reverse=True)[:2]
    expected = {f"epoch={by_step[step]['epoch']}-step={step}.ckpt": throughput(by_step[step]) for step in best}
    assert r0["best_k_checkpoints"] == r1["best_k_checkpoints"]
    assert r0["best_k_checkpoints"] == pytest.approx(expected, rel=1e-6)
    assert r0["checkpoints"] == sorted(expected)  # rank 0 wrote each, and removed those overtaken


@pytest.mark.timeout(200)
def test_early_stopping_on_an_elche_series_stops_every_rank_at_the_same_step(tmp_path):
    """EarlyStopping(monitor="elche/rank1/share", min_delta=10, patience=1) cannot see an improvement after
    the first epoch: every rank stops at epoch 1's last boundary. A ModelCheckpoint on the same series at
    each epoch's end keeps the epoch with the larger share, the same file on every rank."""
    results = run_scenario(
        tmp_path, epochs=5, samples=256, slow={"1": 2.0}, elche={"anchor": 4},
        early_stopping={"monitor": "elche/rank1/share", "min_delta": 10.0, "patience": 1},
        checkpoint_monitor={"monitor": "elche/rank1/share", "mode": "max"},
    )
    boundaries = results[0]["boundaries"]
    last = [max((b for b in boundaries if b["epoch"] == epoch), key=lambda b: b["window"]) for epoch in (0, 1)]
    assert {b["epoch"] for b in boundaries} == {0, 1}
    assert [r["global_step"] for r in results] == [last[1]["cohort_step"]] * 2
    shares = [b["samples"][1] / sum(b["samples"]) for b in last]
    kept = last[1] if shares[1] > shares[0] else last[0]  # a tie keeps the first
    name = f"epoch={kept['epoch']}-step={kept['cohort_step']}.ckpt"
    assert [r["best_checkpoint"] for r in results] == [name, name] and results[0]["checkpoints"] == [name]
