"""The elche/ metrics, the progress bar (total, anchor, share) and the end-of-fit summary."""

from __future__ import annotations

import re

import pytest
from conftest import run_scenario

from lightning_elche.cohort.records import BoundaryRecord
from lightning_elche.lightning.telemetry import boundary_metrics, summary


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


def test_summary_table():
    text = summary([record(), record(cohort_step=70)], wall_s=12.5)
    assert text.startswith("ElChe summary: 12.5 s of training, 640 samples, 2 boundaries, final anchor 10")
    assert "estimated speedup vs DDP" in text
    assert "     0 | 75.0% | 100.0%" in text and "     1 | 25.0% | 83.3%" in text


@pytest.mark.timeout(200)
def test_tensorboard_event_files_hold_one_elche_point_per_boundary(tmp_path):
    """A real fit with a TensorBoardLogger; the event files are read back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_scenario(
        tmp_path, epochs=2, samples=512, slow={"1": 2.0}, tensorboard=True, log_seen=True, progress_bar=True,
        elche={"anchor": 4, "scalar_reductions": {"seen": "sum", "rank": "max"}},
    )
    boundaries = results[0]["boundaries"]
    [events_file] = (tmp_path / "out" / "tb").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("elche/anchor", "elche/overhead", "elche/throughput", "elche/rank0/share", "elche/rank1/idle"):
        assert tag in tags, sorted(t for t in tags if t.startswith("elche/"))
    anchor = events.Scalars("elche/anchor")
    assert [e.step for e in anchor] == [b["cohort_step"] for b in boundaries]
    assert [e.value for e in anchor] == [b["anchor"] for b in boundaries]
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
    assert [e.value for e in events.Scalars("elche/user/seen")] == seen
