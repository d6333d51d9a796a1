"""Cohort simulator: the strategy's own cohort core against simulated ranks, and its command line."""

from __future__ import annotations

import json
import math

import pytest

from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.link import WIRE_BYTES_PER_PAYLOAD_BYTE
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.sim import plot as sim_plot
from lightning_elche.sim.cli import main
from lightning_elche.sim.elastic import simulate_elastic
from lightning_elche.sim.simulator import SimResult, SpeedChange, simulate_cohort, spread_speeds


def test_equal_speeds_leave_no_idle_and_reach_the_ideal():
    result = simulate_cohort([1.0] * 4, step_ms=50.0, noise=0.02, boundary_ms=1.0, steps=2000, seed=1)
    assert max(result.idle_fraction) < 0.02
    assert result.fraction_of_ideal > 0.97
    assert result.final_counts == (10, 10, 10, 10)


def test_k2_beats_the_ddp_estimate_by_far():
    result = simulate_cohort([1.0, 0.5], step_ms=50.0, noise=0.05, boundary_ms=5.0, steps=2000)
    # Ideal is 1.5x one rank; DDP runs both at the slow rank's pace (1x), ElChe close to 1.5x.
    assert result.speedup_vs_ddp > 1.35
    assert result.fraction_of_ideal > 0.93
    assert result.ddp.idle_fraction[0] > 0.4  # under DDP the fast rank waits half of every step
    assert result.idle_fraction[0] < 0.1


def test_shares_follow_speeds():
    result = simulate_cohort([1.0, 0.5, 0.25], step_ms=20.0, noise=0.05, boundary_ms=2.0, steps=3000, seed=3)
    for share, expected in zip(result.final_shares, (4 / 7, 2 / 7, 1 / 7)):
        assert share == pytest.approx(expected, abs=0.03)
    assert result.anchor_rank == 2


def test_first_windows_are_probes_like_the_real_controller():
    result = simulate_cohort([1.0, 0.25], step_ms=10.0, boundary_ms=1.0, steps=500, dispatch="planned")
    # Windows 0 and 1 are frozen at the epoch start, window 2 after the warm-up boundary: all probes.
    assert [b.steps for b in result.boundaries[:3]] == [(1, 1)] * 3
    assert result.boundaries[3].steps == (40, 10)


def test_a_speed_change_is_followed_within_a_few_boundaries():
    change = SpeedChange(rank=1, at_step=400, speed=0.5)
    result = simulate_cohort([1.0, 1.0], step_ms=20.0, noise=0.02, boundary_ms=2.0, steps=1500, speed_changes=[change])
    cohort_step = 0
    before, after = [], []
    for boundary in result.boundaries:
        window_start = cohort_step
        cohort_step += sum(boundary.steps) // 2
        (before if window_start < change.at_step else after).append(boundary.shares[0])
    assert before[-1] == pytest.approx(0.5, abs=0.03)
    assert after[5] == pytest.approx(2 / 3, abs=0.04)  # the controller caught up within six windows
    assert after[-1] == pytest.approx(2 / 3, abs=0.03)
    assert result.anchor_rank == 1


def test_same_seed_same_result_other_seed_other_result():
    kwargs = dict(step_ms=30.0, noise=0.1, boundary_ms=3.0, steps=800)
    first = simulate_cohort([1.0, 0.6, 0.3], seed=7, **kwargs)
    again = simulate_cohort([1.0, 0.6, 0.3], seed=7, **kwargs)
    other = simulate_cohort([1.0, 0.6, 0.3], seed=8, **kwargs)
    assert first == again
    assert first.as_dict()["boundaries"] == again.as_dict()["boundaries"]
    assert first != other


def test_epochs_and_step_budget_are_respected():
    result = simulate_cohort(
        [1.0, 0.5], step_ms=10.0, boundary_ms=1.0, batch_size=64, epochs=3, epoch_samples=64 * 256
    )
    per_epoch = {}
    for boundary in result.boundaries:
        per_epoch[boundary.epoch] = per_epoch.get(boundary.epoch, 0) + sum(boundary.steps)
    assert per_epoch == {0: 256, 1: 256, 2: 256}  # no window spans two epochs
    assert result.samples == 3 * 64 * 256

    budget = simulate_cohort([1.0, 0.4, 0.3], step_ms=10.0, boundary_ms=1.0, steps=1000)
    assert budget.cohort_steps == 1000  # the last windows are cut to land on the budget


def test_the_simulator_runs_the_cores_plan_not_a_copy(monkeypatch):
    """Change how the core plans windows and the simulator follows: it has no plan of its own."""
    kwargs = dict(step_ms=10.0, boundary_ms=1.0, batch_size=8, epochs=2, epoch_samples=8 * 301, dispatch="planned")
    plain = simulate_cohort([1.0, 0.25], **kwargs)
    assert max(max(b.steps) for b in plain.boundaries) > 3  # the controller asks for long windows here

    frozen: list[tuple[int, tuple[int, ...]]] = []  # (epoch, steps per rank) of every window the core froze
    open_windows, freeze = EpochPlan.open_windows, EpochPlan.freeze

    def capped(self, next_window, plan_steps, *args):  # a different planning rule: at most 3 steps per rank and window
        return open_windows(self, next_window, lambda: [min(count, 3) for count in plan_steps()], *args)

    def recording_freeze(self, steps):
        freeze(self, steps)
        window = len(self.sizes) - 1
        frozen.append((self.epoch, tuple(self.steps(window, rank) for rank in range(self.world_size))))

    monkeypatch.setattr(EpochPlan, "open_windows", capped)
    monkeypatch.setattr(EpochPlan, "freeze", recording_freeze)
    result = simulate_cohort([1.0, 0.25], **kwargs)
    # Every boundary closes a window the core froze, in order, and no other window is run.
    assert [(b.epoch, b.steps) for b in result.boundaries] == frozen
    for epoch in (0, 1):
        windows = [b.steps for b in result.boundaries if b.epoch == epoch]
        assert max(map(max, windows[:-1])) <= 3  # the changed rule, seen by the simulator
        assert sum(map(sum, windows)) == 301  # the core's last window of the epoch split what remained
    assert result.samples == plain.samples == 2 * 8 * 301
    assert [b.steps for b in result.boundaries] != [b.steps for b in plain.boundaries]


def test_seconds_bound_the_simulated_clock():
    result = simulate_cohort([1.0, 0.5], step_ms=10.0, boundary_ms=1.0, seconds=5.0)
    assert 5.0 <= result.seconds < 5.0 + result.boundaries[-1].window_ms / 1000.0 + 0.01


def test_1024_ranks_complete():
    result = simulate_cohort(spread_speeds(1024, 4.0), step_ms=100.0, noise=0.05, boundary_ms=20.0, steps=300)
    assert result.world_size == 1024
    assert result.cohort_steps >= 300
    assert result.speedup_vs_ddp > 1.0
    assert len(result.controller_us) == len(result.boundaries)


def test_config_and_arguments_are_checked():
    with pytest.raises(ValueError, match="run a length"):
        simulate_cohort([1.0, 1.0])
    with pytest.raises(ValueError, match="ranks are 0..1"):
        simulate_cohort([1.0, 1.0], steps=10, speed_changes=[SpeedChange(rank=2, at_step=1, speed=0.5)])
    with pytest.raises(ValueError, match="world_size is 3"):
        simulate_cohort([1.0, 1.0], steps=10, config=ControllerConfig(world_size=3))
    with pytest.raises(ValueError, match="blocking boundaries"):
        simulate_cohort([1.0, 1.0], steps=10, config=ControllerConfig(world_size=2, policy="async"))
    with pytest.raises(ValueError, match="speed of rank 1"):
        simulate_cohort([1.0, 0.0], steps=10)


# --------------------------------------------------------------------------------- slow links

FOUR_MB = 4_000_000
FOUR_MB_AT_100 = 320.0 * WIRE_BYTES_PER_PAYLOAD_BYTE  # 4 MB * 8 bit / 100 Mbit/s, in TCP frames with ACKs


def simulate_link(**link) -> SimResult:
    """Two equal ranks at 5 ms a step whose boundary moves ``link``'s bytes, noise-free and planned."""
    return simulate_cohort(
        [1.0, 1.0], step_ms=5.0, boundary_ms=1.0, noise=0.0, steps=20000, dispatch="planned",
        config=ControllerConfig(world_size=2, max_anchor=5000), **link,
    )


def test_without_a_link_the_bytes_change_nothing():
    assert simulate_link(boundary_bytes=FOUR_MB, model_bytes=FOUR_MB) == simulate_link()


def test_a_slow_link_costs_more_per_boundary_and_grows_the_anchor_more():
    slow = simulate_link(link_mbit_s=100.0, boundary_bytes=FOUR_MB)
    fast = simulate_link(link_mbit_s=1000.0, boundary_bytes=FOUR_MB)
    assert slow.boundaries[0].boundary_ms == pytest.approx(1.0 + FOUR_MB_AT_100)
    assert fast.boundaries[0].boundary_ms == pytest.approx(1.0 + FOUR_MB_AT_100 / 10)
    assert slow.final_anchor > fast.final_anchor > 10
    assert slow.ddp.samples_per_s < fast.ddp.samples_per_s  # DDP pays the link every step


def test_the_controller_is_sized_for_the_link_at_its_first_calibration():
    """The anchor that keeps 349 ms under 5 % of a window of 5 ms steps, from the first decision on;
    told only the cost (no link), the controller gets there later and the run is slower."""
    hinted = simulate_link(link_mbit_s=100.0, boundary_bytes=FOUR_MB)
    first_decision = next(b.anchor for b in hinted.boundaries if b.anchor != 10)
    assert first_decision == math.ceil(FOUR_MB_AT_100 * 0.95 / (0.05 * 5.0)) == 1327
    assert hinted.boundaries[1].anchor == 1327  # warm-up window, then one probe: the first calibration
    unhinted = simulate_cohort(
        [1.0, 1.0], step_ms=5.0, boundary_ms=321.0, noise=0.0, steps=20000, dispatch="planned",
        config=ControllerConfig(world_size=2, max_anchor=5000),
    )
    assert unhinted.boundaries[1].anchor == 10
    assert hinted.samples_per_s > unhinted.samples_per_s


def test_compressing_the_payload_shortens_the_window_and_speeds_up_a_slow_link():
    full = simulate_link(link_mbit_s=100.0, boundary_bytes=FOUR_MB)
    compressed = simulate_link(link_mbit_s=100.0, boundary_bytes=FOUR_MB // 4, model_bytes=FOUR_MB)
    assert compressed.final_anchor < full.final_anchor
    assert compressed.samples_per_s > full.samples_per_s
    assert compressed.ddp == full.ddp  # DDP still all-reduces the uncompressed model


def test_a_config_naming_its_own_link_keeps_it():
    own = ControllerConfig(world_size=2, max_anchor=5000, link_mbit_s=1000.0, boundary_bytes=FOUR_MB)
    told = simulate_cohort([1.0, 1.0], step_ms=5.0, boundary_ms=1.0, noise=0.0, steps=5000, dispatch="planned",
                           config=own, link_mbit_s=100.0, boundary_bytes=FOUR_MB)
    assert told.boundaries[1].anchor == math.ceil(FOUR_MB_AT_100 / 10 * 0.95 / (0.05 * 5.0))  # sized for its 1 Gbit/s


@pytest.mark.parametrize("link, match", [
    (dict(link_mbit_s=0.0), "link_mbit_s"),
    (dict(link_mbit_s=math.nan), "link_mbit_s"),
    (dict(link_mbit_s=100.0, link_latency_ms=-1.0), "link_latency_ms"),
    (dict(link_latency_ms=2.0), "needs link_mbit_s"),
    (dict(link_mbit_s=100.0, boundary_bytes=-1), "boundary_bytes"),
    (dict(link_mbit_s=100.0, model_bytes=-1), "model_bytes"),
])
def test_link_arguments_are_checked(link, match):
    with pytest.raises(ValueError, match=match):
        simulate_cohort([1.0, 1.0], steps=10, **link)


def test_spread_speeds_span_fastest_to_slowest():
    speeds = spread_speeds(5, 4.0)
    assert speeds[0] == 1.0 and speeds[-1] == pytest.approx(0.25)
    assert speeds == sorted(speeds, reverse=True)


# --------------------------------------------------------------------------------- command line


def test_cli_prints_the_prediction(capsys):
    assert main(["--speeds", "1.0,0.5,0.25", "--steps", "500", "--speed-change", "0:250:0.5"]) == 0
    out = capsys.readouterr().out
    assert "ElChe (predicted)" in out and "DDP (estimate)" in out and "ElChe vs DDP" in out
    assert "controller cost per boundary at 3 ranks" in out


def test_cli_summarises_many_ranks_and_prints_json(capsys):
    main(["--ranks", "32", "--spread", "3", "--steps", "200"])
    assert "median" in capsys.readouterr().out
    main(["--speeds", "1,0.5", "--steps", "200", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and data["boundaries"] and data["speedup_vs_ddp"] > 1


def test_cli_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sim_plot, "matplotlib_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["--speeds", "1,0.5", "--steps", "100", "--plot", str(tmp_path / "run.png")])
    assert "pip install matplotlib" in capsys.readouterr().err


def test_cli_simulates_a_link_and_names_it(capsys):
    assert main(["--speeds", "1,1", "--step-ms", "5", "--boundary-ms", "1", "--steps", "2000", "--noise", "0",
                 "--link-mbit-s", "100", "--link-latency-ms", "2", "--boundary-bytes", "1000000",
                 "--model-bytes", "4000000"]) == 0
    out = capsys.readouterr().out
    assert "boundary 90.2928 ms" in out  # 1 + 2 + 80 * 1.0912: a quarter of the model over the link, in TCP frames
    assert "DDP all-reduce 352.171 ms/step" in out  # 1 + 2 + FOUR_MB_AT_100
    assert "link 100 Mbit/s, 2 ms latency: 1 MB per boundary, 4 MB per DDP step" in out


@pytest.mark.parametrize("bad", [["--speeds", "1,x"], ["--speeds", "1,0.5", "--speed-change", "1:5"],
                                 ["--speeds", "1,0.5", "--link-mbit-s", "0"]])
def test_cli_rejects_malformed_values(bad, capsys):
    with pytest.raises(SystemExit):
        main(bad)
    assert "error" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):  # matplotlib is in the test extra
    result = simulate_cohort(spread_speeds(12, 3.0), step_ms=10.0, boundary_ms=1.0, steps=300)
    sim_plot.plot(result, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- elastic cohorts (sim/elastic.py)

ELASTIC_FIT = {"step_ms": 50.0, "batch_size": 32, "epochs": 3, "epoch_samples": 9984}


def test_an_elastic_fit_without_failures_is_the_failure_free_fit():
    result = simulate_elastic([1.0, 0.5, 0.25], fail_every_s=None, **ELASTIC_FIT)
    assert result.goodput == 1.0 and result.failures == result.joins == result.lost_samples == 0
    assert result.useful_samples == 3 * 9984


def test_failures_cost_goodput_and_every_sample_is_still_trained_once_per_epoch():
    """The failed rank's window goes back to the epoch (the strategy's survivors_point); the re-planned
    rest loses at most what drop_last drops when fewer than a batch per rank remain at an epoch's end."""
    result = simulate_elastic([1.0, 0.5, 0.25], fail_every_s=5, rejoin_s=1.6, **ELASTIC_FIT)
    assert 0.3 < result.goodput < 0.95
    assert result.failures >= 5 and result.joins >= result.failures - 1  # the last one may find the fit ended
    assert result.lost_samples > 0
    assert 0 <= 3 * 9984 - result.useful_samples < 3 * 3 * 32


def test_a_failure_inside_a_boundary_loses_the_victims_whole_window():
    """Two ranks, one-step probe windows of 100 ms, 100 ms boundaries: the failure at 150 ms lands inside
    the first boundary, which rolls back, so the victim's window (one step) goes back to the epoch and
    the survivor redoes the boundary after it found the death (150 ms + detection, regroup, boundary)."""
    fit = {**ELASTIC_FIT, "step_ms": 100.0, "epochs": 1, "rejoin_s": None, "detect_s": 0.1, "regroup_ms": 100.0}
    inside = simulate_elastic([1.0, 1.0], fail_every_s=0.15, boundary_ms=100.0, **fit)
    assert inside.failures == 1 and inside.lost_samples == ELASTIC_FIT["batch_size"]
    # the same instant with 10 ms boundaries is early in the second window: the victim had trained nothing of it
    in_window = simulate_elastic([1.0, 1.0], fail_every_s=0.15, boundary_ms=10.0, **fit)
    assert in_window.failures == 1 and in_window.lost_samples == 0


def test_goodput_rises_with_faster_detection_and_rejoining_and_falls_with_more_failures():
    def goodput(**changes):
        return simulate_elastic([1.0, 1.0, 1.0], **{"fail_every_s": 5.0, "detect_s": 0.1, "rejoin_s": 1.6, **ELASTIC_FIT,
                                                    **changes}).goodput

    assert goodput(detect_s=1.5) < goodput()  # a stalled rank (heartbeat probe) against an exit the launcher saw
    assert goodput(rejoin_s=8.0) < goodput()  # a replacement started after the failure against a spare
    assert goodput(fail_every_s=2.0) < goodput() < goodput(fail_every_s=20.0)
    assert goodput(rejoin_s=None) < goodput()  # never replaced: the cohort shrinks for good


def test_random_failures_are_seeded_and_elastic_arguments_are_checked():
    one = simulate_elastic([1.0, 0.5], fail_every_s=3, random_failures=True, seed=4, **ELASTIC_FIT)
    assert one == simulate_elastic([1.0, 0.5], fail_every_s=3, random_failures=True, seed=4, **ELASTIC_FIT)
    assert one != simulate_elastic([1.0, 0.5], fail_every_s=3, random_failures=True, seed=5, **ELASTIC_FIT)
    with pytest.raises(ValueError, match="fail_every_s must be a positive number"):
        simulate_elastic([1.0], fail_every_s=0, **ELASTIC_FIT)
    with pytest.raises(ValueError, match="detect_s must be a number >= 0"):
        simulate_elastic([1.0, 1.0], fail_every_s=5, detect_s=-1, **ELASTIC_FIT)
    with pytest.raises(ValueError, match="speeds must be positive"):
        simulate_elastic([1.0, 0.0], fail_every_s=5, **ELASTIC_FIT)
