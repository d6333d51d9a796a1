"""Unit tests for the pure ElChe controller (lightning_elche/cohort/controller.py).

Synthetic timings only: no processes, no torch.distributed. Every rank runs this code on the same
all-reduced numbers, so its decisions must follow the documented rules exactly (DESIGN.md section 6)
and be a pure function of its inputs.
"""

from __future__ import annotations

import io
import math
from typing import Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_elche.cohort.controller import (
    DEAD_ZONE,
    SPEED_WINDOW,
    STABLE_AFTER,
    controller_state_for,
    Controller,
    ControllerConfig,
    WindowReport,
    split_by_weights,
)
from lightning_elche.cohort.link import WIRE_BYTES_PER_PAYLOAD_BYTE, link_ms

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def make(world: int = 2, **kwargs) -> Controller:
    return Controller(ControllerConfig(world_size=world, **kwargs))


def report(
    ctrl: Controller, ms_per_step: Sequence[float], boundary_ms: Optional[Sequence[float]] = None
) -> WindowReport:
    """The report of a window in which every rank ran the counts it was given at ``ms_per_step``."""
    steps = list(ctrl.counts)
    world = len(steps)
    return WindowReport(
        window_ms=[m * s for m, s in zip(ms_per_step, steps)],
        steps=steps,
        boundary_ms=list(boundary_ms) if boundary_ms is not None else [0.0] * world,
    )


def feed(
    ctrl: Controller,
    ms_per_step: Sequence[float],
    windows: int = SPEED_WINDOW,
    boundary_ms: Optional[Sequence[float]] = None,
    growth_allowed: bool = True,
) -> None:
    """Run ``windows`` windows at constant speeds; after SPEED_WINDOW of them the mean is exact."""
    for _ in range(windows):
        ctrl.observe(report(ctrl, ms_per_step, boundary_ms), growth_allowed=growth_allowed)


def calibrate(
    ctrl: Controller, ms_per_step: Sequence[float], boundary_ms: Optional[Sequence[float]] = None
) -> None:
    """Feed constant-speed windows until the controller makes its first calibrated decision.

    Robust to start-up handling: a controller may discard the fit's first window (it carries
    start-up costs) or probe with short windows before it has a reading from every rank.
    """
    for _ in range(3):
        if ctrl.calibrations >= 1:
            return
        ctrl.observe(report(ctrl, ms_per_step, boundary_ms))
    assert ctrl.calibrations == 1, "no calibrated decision after three windows at constant speeds"


def boundary_for(overhead: float, window_ms: float) -> float:
    """Boundary time that makes ``fixed / (window + fixed)`` equal ``overhead``."""
    return overhead * window_ms / (1.0 - overhead)


# --------------------------------------------------------------------------- config


def test_config_rejects_bad_values():
    """Misconfiguration must fail at construction, with the offending value named."""
    with pytest.raises(ValueError, match="world_size"):
        ControllerConfig(world_size=0)
    with pytest.raises(ValueError, match="policy"):
        ControllerConfig(world_size=2, policy="fast")
    with pytest.raises(ValueError, match="one ratio per rank"):
        ControllerConfig(world_size=3, partition_ratios=[1.0, 2.0])


def test_min_anchor_defaults_to_anchor():
    """Without an explicit floor the anchor never tunes below where it started."""
    assert ControllerConfig(world_size=2, anchor=7).min_anchor == 7
    assert ControllerConfig(world_size=2, anchor=7, min_anchor=3).min_anchor == 3


def test_initial_counts_are_equal_and_within_anchor():
    """Before any timing exists nothing is known about speeds: equal counts, at most the anchor."""
    ctrl = make(4, anchor=12)
    assert ctrl.anchor == 12
    assert len(set(ctrl.counts)) == 1
    assert 1 <= ctrl.counts[0] <= 12
    assert ctrl.ms_per_step == [None] * 4
    assert not ctrl.calibrated
    assert ctrl.shares == pytest.approx([0.25] * 4)


def test_report_with_wrong_world_size_is_rejected():
    """A report that does not carry one entry per rank is a wiring bug and must not be folded in."""
    ctrl = make(3)
    with pytest.raises(ValueError, match="one entry per rank"):
        ctrl.observe(WindowReport(window_ms=[1.0, 1.0], steps=[1, 1], boundary_ms=[0.0, 0.0]))
    with pytest.raises(ValueError, match="one entry per rank"):
        ctrl.observe(WindowReport(window_ms=[1.0] * 3, steps=[1, 1], boundary_ms=[0.0] * 3))


# --------------------------------------------------------------------------- speeds


def test_speed_pools_the_last_five_windows():
    """Speed = total ms / total steps over the last SPEED_WINDOW=5 windows; older ones drop out.

    Pooling weighs a long window more than a one-step window, unlike a mean of per-window ratios.
    """
    ctrl = make(2, anchor=4)
    steps = {k: 1 + (k % 3) * 4 for k in range(1, 8)}  # 5, 9, 1, 5, 9, 1, 5 steps: pooling != mean
    for k in range(1, 8):  # rank 0 runs at k ms/step in window k; rank 1 stays at 10 ms/step
        ctrl.observe(WindowReport(window_ms=[k * steps[k], 10.0 * steps[k]], steps=[steps[k]] * 2, boundary_ms=[0.0, 0.0]))
    ms = ctrl.ms_per_step
    recent = range(3, 8)  # windows 3..7
    assert ms[0] == pytest.approx(sum(k * steps[k] for k in recent) / sum(steps[k] for k in recent))
    assert ms[0] != pytest.approx(sum(recent) / 5)
    assert ms[1] == pytest.approx(10.0)


def test_speed_is_window_time_over_steps():
    """ms/step is the window's training time divided by the steps actually taken in it."""
    ctrl = make(2, anchor=10)
    for _ in range(2):  # the same window twice: the mean is that window whether or not one is skipped
        ctrl.observe(WindowReport(window_ms=[300.0, 50.0], steps=[3, 10], boundary_ms=[0.0, 0.0]))
    assert ctrl.ms_per_step == pytest.approx([100.0, 5.0])


def test_window_without_steps_or_time_is_no_reading():
    """A rank that did no step (or reports a non-finite time) adds no reading; controller waits."""
    ctrl = make(2, anchor=10)
    initial = list(ctrl.counts)
    for _ in range(2):
        ctrl.observe(WindowReport(window_ms=[100.0, 0.0], steps=[10, 0], boundary_ms=[0.0, 0.0]))
    assert ctrl.ms_per_step == [pytest.approx(10.0), None]
    assert not ctrl.calibrated
    assert ctrl.calibrations == 0
    assert ctrl.counts == initial
    ctrl.observe(WindowReport(window_ms=[100.0, math.inf], steps=[10, 10], boundary_ms=[0.0, 0.0]))
    ctrl.observe(WindowReport(window_ms=[100.0, math.nan], steps=[10, 10], boundary_ms=[0.0, 0.0]))
    assert ctrl.ms_per_step[1] is None
    assert ctrl.calibrations == 0


def test_speed_forgotten_after_five_missed_windows():
    """A rank silent for 5 windows loses its stale speed and the plan freezes until it reports."""
    ctrl = make(2, anchor=10)
    feed(ctrl, [100.0, 50.0], windows=2)
    counts = list(ctrl.counts)
    assert counts == [10, 20]
    for _ in range(4):
        ctrl.observe(WindowReport(window_ms=[1000.0, 0.0], steps=[10, 0], boundary_ms=[0.0, 0.0]))
    assert ctrl.ms_per_step[1] == pytest.approx(50.0)  # four misses: still remembered
    ctrl.observe(WindowReport(window_ms=[1000.0, 0.0], steps=[10, 0], boundary_ms=[0.0, 0.0]))
    assert ctrl.ms_per_step[1] is None  # fifth miss: forgotten
    assert not ctrl.calibrated
    calibrations = ctrl.calibrations
    ctrl.observe(WindowReport(window_ms=[1000.0, 0.0], steps=[10, 0], boundary_ms=[0.0, 0.0]))
    assert ctrl.calibrations == calibrations  # no decision without every rank's speed
    assert ctrl.counts == counts


# --------------------------------------------------------------------------- election


def test_slowest_rank_is_elected_ties_to_lower_rank():
    """The anchor rank is the slowest; among equals the lowest rank, so every rank agrees."""
    ctrl = make(3)
    calibrate(ctrl, [50.0, 100.0, 80.0])
    assert ctrl.anchor_rank == 1
    ctrl = make(4)
    calibrate(ctrl, [100.0, 50.0, 100.0, 100.0])
    assert ctrl.anchor_rank == 0


def test_challenger_five_percent_slower_does_not_unseat_anchor():
    """Hysteresis: a rank only 5 % slower than the anchor rank leaves the election unchanged."""
    ctrl = make(2)
    feed(ctrl, [100.0, 100.0])
    assert ctrl.anchor_rank == 0
    feed(ctrl, [100.0, 105.0])
    assert ctrl.ms_per_step == pytest.approx([100.0, 105.0])
    assert ctrl.anchor_rank == 0


def test_challenger_twenty_percent_slower_unseats_anchor():
    """A rank 20 % slower is no noise: it becomes the anchor rank."""
    ctrl = make(2)
    feed(ctrl, [100.0, 100.0])
    assert ctrl.anchor_rank == 0
    feed(ctrl, [100.0, 120.0])
    assert ctrl.anchor_rank == 1


def test_margin_is_ten_percent_inside_the_band():
    """Within the 15 % cohort band the 10 % margin decides: 8 % keeps the anchor, 12 % takes it."""
    ctrl = make(2)
    feed(ctrl, [100.0, 100.0])
    feed(ctrl, [100.0, 108.0])
    assert ctrl.anchor_rank == 0
    ctrl = make(2)
    feed(ctrl, [100.0, 100.0])
    feed(ctrl, [100.0, 112.0])  # 100 >= 0.85 * 112: rank 0 is still in the cohort
    assert ctrl.anchor_rank == 1


def test_hysteresis_holds_in_both_directions():
    """Once rank 1 is the anchor, rank 0 creeping 4 % above it does not flip the election back."""
    ctrl = make(2)
    feed(ctrl, [100.0, 120.0])
    assert ctrl.anchor_rank == 1
    feed(ctrl, [125.0, 120.0])
    assert ctrl.anchor_rank == 1
    feed(ctrl, [150.0, 120.0])
    assert ctrl.anchor_rank == 0


def test_anchor_rank_outside_band_is_replaced_by_slowest():
    """If the anchor rank became fast (left the 15 % band), the slowest rank takes over at once."""
    ctrl = make(3)
    feed(ctrl, [100.0, 90.0, 50.0])
    assert ctrl.anchor_rank == 0
    feed(ctrl, [20.0, 90.0, 50.0])
    assert ctrl.anchor_rank == 1


# --------------------------------------------------------------------------- counts


def test_counts_are_proportional_to_speed():
    """n_r = round(anchor * slow_ms / ms_r): a rank s times faster runs about s times more steps."""
    ctrl = make(3, anchor=10)
    calibrate(ctrl, [100.0, 30.0, 70.0])
    assert ctrl.anchor_rank == 0
    assert ctrl.counts == [10, round(10 * 100 / 30), round(10 * 100 / 70)] == [10, 33, 14]
    assert ctrl.shares == pytest.approx([10 / 57, 33 / 57, 14 / 57])


def test_counts_follow_the_anchor_rank_not_the_slowest():
    """Under hysteresis a slower non-anchor rank runs slightly fewer steps than the anchor."""
    ctrl = make(2, anchor=10)
    feed(ctrl, [100.0, 100.0])
    feed(ctrl, [100.0, 108.0])
    assert ctrl.anchor_rank == 0
    assert ctrl.counts == [10, round(10 * 100 / 108)] == [10, 9]


def test_speed_ratio_capped_at_64():
    """An absurdly fast rank (or a bogus timing) runs at most 64x the anchor's steps."""
    ctrl = make(3, anchor=10)
    calibrate(ctrl, [6400.0, 1.0, 100.0])
    assert ctrl.counts == [10, 640, 640]


def test_counts_at_least_one():
    """Every rank runs at least one step per window, even with anchor 1 and a slower peer."""
    ctrl = make(2, anchor=1)
    feed(ctrl, [100.0, 100.0])
    feed(ctrl, [100.0, 109.0])  # within the margin: rank 1 stays below the anchor rank's speed
    assert ctrl.anchor_rank == 0
    assert ctrl.counts == [1, 1]
    assert min(ctrl.counts) >= 1


def test_dead_zone_keeps_small_changes():
    """A count moves only when the new target differs by more than 5 % of the current count."""
    ctrl = make(2, anchor=10)
    feed(ctrl, [100.0, 50.0])
    assert ctrl.counts == [10, 20]
    feed(ctrl, [100.0, 47.8])  # target round(20.92) = 21: |21 - 20| = 1 <= 5 % of 20
    assert round(10 * 100 / ctrl.ms_per_step[1]) == 21
    assert ctrl.counts == [10, 20]
    feed(ctrl, [100.0, 45.0])  # target round(22.2) = 22: 2 > 1, applied
    assert ctrl.counts == [10, 22]


def test_dead_zone_not_applied_on_first_calibration():
    """The first calibrated window replaces the blind initial counts whatever the difference."""
    ctrl = make(2, anchor=20)
    ctrl.counts = [20, 20]  # as if the blind start had been anchor steps everywhere
    calibrate(ctrl, [100.0, 95.0])  # target 21 is within 5 % of 20
    assert ctrl.counts == [20, 21]


def test_max_batch_diff_caps_the_lead():
    """max_batch_diff bounds how far any rank's count may run ahead of the smallest count."""
    ctrl = make(3, anchor=10, max_batch_diff=5)
    calibrate(ctrl, [100.0, 30.0, 70.0])
    assert ctrl.counts == [10, 15, 14]
    ctrl = make(3, anchor=10, max_batch_diff=0)
    calibrate(ctrl, [100.0, 30.0, 70.0])
    assert ctrl.counts == [10, 10, 10]


# --------------------------------------------------------------------------- overhead tuning


def test_overhead_uses_cheapest_boundary_and_ignores_bad_ones():
    """Boundary cost is the cheapest rank's boundary (the last to arrive waits for nobody)."""
    ctrl = make(4, anchor=10)
    calibrate(ctrl, [10.0] * 4, boundary_ms=[1000.0, 0.0, math.inf, 25.0])
    assert ctrl.overhead == pytest.approx(25.0 / (100.0 + 25.0))
    ctrl.observe(report(ctrl, [10.0] * 4, [0.0, math.nan, -1.0, 0.0]))
    assert ctrl.overhead == pytest.approx(25.0 / 125.0)  # no usable boundary: left as it was


def test_no_growth_on_first_calibration():
    """The first reading carries warm-up costs (compilation, allocator): it never grows the anchor."""
    ctrl = make(2, anchor=10)
    calibrate(ctrl, [10.0, 10.0], boundary_ms=[1000.0, 1000.0])
    assert ctrl.calibrations == 1
    assert ctrl.overhead > 0.9
    assert ctrl.anchor == 10
    assert ctrl.counts == [10, 10]
    assert ctrl.proposed_anchor is None


def test_anchor_grows_at_most_double_per_boundary():
    """Even a huge overhead only doubles the anchor per boundary, and counts follow the anchor."""
    ctrl = make(2, anchor=10)
    calibrate(ctrl, [10.0, 5.0], boundary_ms=[1000.0, 1000.0])
    anchors = [ctrl.anchor]
    for _ in range(5):
        feed(ctrl, [10.0, 5.0], windows=1, boundary_ms=[1000.0, 1000.0])
        anchors.append(ctrl.anchor)
    assert anchors[:2] == [10, 20]  # first calibration: no growth; then doubled, not x9
    for before, after in zip(anchors, anchors[1:]):
        assert before <= after <= 2 * before
    assert anchors[-1] == 10 * 2**5
    assert ctrl.counts == [ctrl.anchor, 2 * ctrl.anchor]


def test_growth_is_proportional_to_overhead_excess():
    """Below the x2 cap the anchor scales by overhead / target, rounded up."""
    ctrl = make(2, anchor=10)
    feed(ctrl, [10.0, 10.0], windows=SPEED_WINDOW, boundary_ms=[0.0, 0.0])  # calibrate, no growth
    b = boundary_for(0.074, 100.0)
    ctrl.observe(report(ctrl, [10.0, 10.0], [b, b]))
    assert ctrl.overhead == pytest.approx(0.074)
    assert ctrl.anchor == math.ceil(10 * ctrl.overhead / 0.05) == 15


def test_a_new_generations_start_up_does_not_grow_the_anchor():
    """After a member joins, the first boundaries of the new generation carry its start-up (a new
    process group, the joiner's first steps the members wait for): read as the boundary's cost they
    doubled the anchor at every admission. The anchor the old generation tuned holds until the new one
    is stable; a cost that stays high then grows it."""
    ctrl = make(2, anchor=10)
    feed(ctrl, [10.0, 10.0], windows=SPEED_WINDOW + 3, boundary_ms=[1.0, 1.0])
    assert ctrl.anchor == 10 and ctrl.calibrations > 2
    joined = make(3, anchor=10)
    joined.load_state_dict(controller_state_for(ctrl.state_dict(), [0, 1, None]))
    assert joined.counts == [10, 10, 1]
    slow_start = [400.0, 400.0, 400.0]  # the joiner's probe window and the group's first collectives
    while joined.calibrations < STABLE_AFTER - 1:
        joined.observe(report(joined, [10.0, 10.0, 10.0], slow_start))
        assert joined.anchor == 10, joined.calibrations  # start-up read as start-up
    assert joined.overhead > 0.5 and joined.state_dict()["settling"] is True  # a joiner would settle as well
    feed(joined, [10.0, 10.0, 10.0], windows=1, boundary_ms=slow_start)
    assert joined.anchor == 20 and not joined.state_dict()["settling"]  # a boundary that stays this costly is its cost


def test_a_joiner_after_a_loss_takes_the_lost_members_seat_and_its_own_reading_replaces_it():
    """A joiner admitted after a member was lost starts from that member's count and speed (most likely
    its replacement on the same device), not from one-step probe windows in which it idled while the
    members trained; its first reading of its own replaces the inherited ones. A joiner with no loss
    before it probes."""
    ctrl = make(3, anchor=10)
    feed(ctrl, [10.0, 30.0, 10.0], windows=SPEED_WINDOW + 1, boundary_ms=[1.0, 1.0, 1.0])
    assert ctrl.counts == [30, 10, 30]
    short = make(2, anchor=10)
    short.load_state_dict(controller_state_for(ctrl.state_dict(), [0, 2]))  # rank 1, the slow one, lost
    assert short.counts == [30, 30] and short.state_dict()["vacated"][0]["count"] == 10
    refilled = make(3, anchor=10)
    refilled.load_state_dict(controller_state_for(short.state_dict(), [0, 1, None]))
    assert refilled.counts == [30, 30, 10] and refilled.calibrated
    assert refilled.state_dict()["vacated"] == [] and refilled.state_dict()["inherited"] == [2]
    refilled.observe(report(refilled, [10.0, 10.0, 10.0]))  # a generation's first window: start-up, not speed
    refilled.observe(report(refilled, [10.0, 10.0, 10.0]))  # the joiner is as fast as the others
    assert refilled.ms_per_step[2] == pytest.approx(10.0) and refilled.state_dict()["inherited"] == []
    assert refilled.counts == [10, 10, 10]  # all as fast: each the anchor's steps
    grown = make(4, anchor=10)
    grown.load_state_dict(controller_state_for(refilled.state_dict(), [0, 1, 2, None]))  # nobody lost
    assert grown.counts[3] == 1 and not grown.calibrated
    alone = make(1, anchor=10)
    alone.load_state_dict(controller_state_for(ctrl.state_dict(), [0]))  # two lost at once: both seats kept
    back = make(3, anchor=10)
    back.load_state_dict(controller_state_for(alone.state_dict(), [0, None, None]))
    assert back.counts == [30, 10, 30] and back.state_dict()["inherited"] == [1, 2]  # the oldest seat first


def test_growth_only_when_guard_allows():
    """growth_allowed=False (guard not Stable) proposes the growth but does not commit it."""
    ctrl = make(2, anchor=10)
    calibrate(ctrl, [10.0, 10.0], boundary_ms=[25.0, 25.0])
    feed(ctrl, [10.0, 10.0], windows=1, boundary_ms=[25.0, 25.0], growth_allowed=False)
    assert ctrl.anchor == 10
    assert ctrl.proposed_anchor == 20
    assert ctrl.counts == [10, 10]
    ctrl.observe(report(ctrl, [10.0, 10.0], [25.0, 25.0]), growth_allowed=True)
    assert ctrl.anchor == 20
    assert ctrl.proposed_anchor is None
    assert ctrl.counts == [20, 20]


def test_growth_bounded_by_max_anchor():
    """The anchor never exceeds max_anchor however large the overhead."""
    ctrl = make(2, anchor=10, max_anchor=15)
    feed(ctrl, [10.0, 10.0], windows=8, boundary_ms=[1000.0, 1000.0])
    assert ctrl.anchor == 15
    assert ctrl.counts == [15, 15]


def test_overhead_below_target_leaves_anchor_alone():
    """A cheap boundary (overhead under target) never changes the anchor."""
    ctrl = make(2, anchor=10)
    b = boundary_for(0.04, 100.0)
    feed(ctrl, [10.0, 10.0], windows=12, boundary_ms=[b, b])
    assert ctrl.overhead == pytest.approx(0.04)
    assert ctrl.anchor == 10
    assert ctrl.proposed_anchor is None


def test_warm_up_needs_twice_the_target():
    """During warm-up (calibrations 2..4) growth fires only above 2x target; afterwards at 1x."""
    ctrl = make(2, anchor=10)
    b = boundary_for(0.072, 100.0)
    calibrate(ctrl, [10.0, 10.0], [b, b])
    while ctrl.calibrations < 4:
        ctrl.observe(report(ctrl, [10.0, 10.0], [b, b]))
        assert ctrl.overhead == pytest.approx(0.072)
        assert ctrl.anchor == 10
    ctrl.observe(report(ctrl, [10.0, 10.0], [b, b]))
    assert ctrl.calibrations == 5
    assert ctrl.anchor == math.ceil(10 * ctrl.overhead / 0.05) == 15


def test_binding_window_cap_blocks_growth():
    """When the window already spans the epoch cap, growing the anchor would be pointless."""
    ctrl = make(2, anchor=10)
    ctrl.set_max_total_steps(20)
    feed(ctrl, [10.0, 10.0], windows=6, boundary_ms=[1000.0, 1000.0])
    assert ctrl.anchor == 10
    assert sum(ctrl.counts) <= 20


# --------------------------------------------------------------------------- link

SLOW_LINK = dict(boundary_bytes=4_000_000, link_mbit_s=100.0, overhead_target=0.05, max_anchor=5000)
# 4 MB * 8 bit / 100 Mbit/s = 320 ms of payload, 349 ms in TCP's frames with the other direction's ACKs
FOUR_MB_AT_100 = 320.0 * WIRE_BYTES_PER_PAYLOAD_BYTE
LINK_SIZED = 1327  # the anchor that keeps FOUR_MB_AT_100 under 5 % of a window of 5 ms steps


def anchor_meeting(boundary_ms: float, ms_per_step: float, target: float = 0.05) -> int:
    """The fewest anchor steps whose window keeps ``boundary_ms`` at most ``target`` of it."""
    return math.ceil(boundary_ms * (1.0 - target) / (target * ms_per_step))


def test_link_ms_is_a_ring_all_reduce():
    """Each rank sends 2 (W - 1) / W of the payload; the latency is paid once; one rank pays nothing."""
    assert link_ms(4_000_000, 1, 100.0, 5.0) == 0.0
    assert link_ms(4_000_000, 2, 100.0, 0.0) == pytest.approx(FOUR_MB_AT_100)
    assert link_ms(4_000_000, 4, 100.0, 2.0) == pytest.approx(2.0 + 1.5 * FOUR_MB_AT_100)
    assert link_ms(4_000_000, 2, 1000.0, 0.0) == pytest.approx(FOUR_MB_AT_100 / 10)


def test_the_link_carries_tcps_frames_and_the_other_directions_acks():
    """1448 bytes of a tensor in a 1538-byte frame on the line, and half an 84-byte ACK frame."""
    assert WIRE_BYTES_PER_PAYLOAD_BYTE == pytest.approx((1538 + 84 / 2) / 1448)
    assert FOUR_MB_AT_100 == pytest.approx(349.17, abs=0.01)


def test_config_rejects_bad_link_settings():
    """A link setting that cannot describe a link fails at construction, naming the setting."""
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="link_mbit_s"):
            ControllerConfig(world_size=2, link_mbit_s=bad)
    with pytest.raises(ValueError, match="boundary_bytes"):
        ControllerConfig(world_size=2, boundary_bytes=-1)
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="link_latency_ms"):
            ControllerConfig(world_size=2, link_latency_ms=bad)


def test_unknown_link_leaves_the_anchor_to_measurements():
    """Without a bandwidth the payload predicts nothing: anchors are those of a controller without it."""
    plain, with_bytes = make(2, anchor=10), make(2, anchor=10, boundary_bytes=4_000_000, link_latency_ms=3.0)
    assert with_bytes.predicted_boundary_ms is None
    assert make(2, link_mbit_s=100.0).predicted_boundary_ms is None  # a link but no payload: nothing to send
    for k in range(12):
        boundary = [0.0, 0.0] if k < 2 else [300.0 + k, 310.0]
        plain.observe(report(plain, [10.0, 5.0], boundary))
        with_bytes.observe(report(with_bytes, [10.0, 5.0], boundary))
        assert with_bytes.anchor == plain.anchor and with_bytes.counts == plain.counts
        assert with_bytes.overhead == plain.overhead
    assert plain.anchor > 10  # the measured boundaries did grow it


def test_known_slow_link_sizes_the_anchor_on_the_first_calibration():
    """4 MB over 100 Mbit/s costs 349 ms a boundary; at 5 ms a step the target needs 1327 steps at once.

    Without the hint the same first reading (measured 349 ms) carries warm-up costs and grows nothing.
    """
    hinted = make(2, anchor=10, **SLOW_LINK)
    assert hinted.predicted_boundary_ms == pytest.approx(FOUR_MB_AT_100)
    calibrate(hinted, [5.0, 5.0])  # no boundary measured yet: the prediction alone sizes it
    expected = anchor_meeting(hinted.predicted_boundary_ms, 5.0)
    assert expected == LINK_SIZED
    assert hinted.anchor == expected
    assert hinted.counts == [expected, expected]
    window = expected * 5.0
    cost = FOUR_MB_AT_100
    assert cost / (window + cost) <= 0.05 < cost / (window - 5.0 + cost)  # the fewest steps that meet it

    unhinted = make(2, anchor=10, overhead_target=0.05, max_anchor=5000)
    calibrate(unhinted, [5.0, 5.0], boundary_ms=[FOUR_MB_AT_100, FOUR_MB_AT_100])
    assert unhinted.anchor == 10


def test_link_sized_anchor_respects_max_anchor_guard_and_window_cap():
    """The jump skips the per-boundary growth cap, not the other bounds."""
    capped = make(2, anchor=10, **{**SLOW_LINK, "max_anchor": 300})
    calibrate(capped, [5.0, 5.0])
    assert capped.anchor == 300

    held = make(2, anchor=10, **SLOW_LINK)
    held.observe(report(held, [5.0, 5.0]), growth_allowed=False)
    held.observe(report(held, [5.0, 5.0]), growth_allowed=False)
    assert held.calibrations == 1
    assert held.anchor == 10
    assert held.proposed_anchor == LINK_SIZED

    binding = make(2, anchor=10, partition_ratios=[1.0, 1.0], **SLOW_LINK)  # windows of 10 + 10 from the start
    binding.set_max_total_steps(20)
    calibrate(binding, [5.0, 5.0])
    assert binding.anchor == 10 and binding.counts == [10, 10]


def test_predicted_cost_is_a_floor_and_measurements_take_over_after_warm_up():
    """A measured boundary cheaper than the link's prediction counts as the prediction; a dearer one
    grows the anchor by the measured rule (at most x2 per boundary) once warm-up is over."""
    ctrl = make(2, anchor=10, **SLOW_LINK)
    calibrate(ctrl, [5.0, 5.0])
    ctrl.observe(report(ctrl, [5.0, 5.0], [1.0, 1.0]))
    assert ctrl.overhead == pytest.approx(FOUR_MB_AT_100 / (LINK_SIZED * 5.0 + FOUR_MB_AT_100))  # the floor, not 1 ms
    assert ctrl.anchor == LINK_SIZED
    feed(ctrl, [5.0, 5.0], windows=3, boundary_ms=[1.0, 1.0])
    assert ctrl.calibrations >= STABLE_AFTER and ctrl.anchor == LINK_SIZED
    dear = 2.0 * FOUR_MB_AT_100  # twice the prediction: overhead ~0.095
    ctrl.observe(report(ctrl, [5.0, 5.0], [dear, dear]))
    assert ctrl.anchor == math.ceil(LINK_SIZED * ctrl.overhead / 0.05)
    assert LINK_SIZED < ctrl.anchor <= 2 * LINK_SIZED


def test_faster_link_or_smaller_payload_needs_a_shorter_window():
    """The anchor scales with the bytes and inversely with the bandwidth."""
    anchors = {}
    for mbit_s, payload in ((100.0, 4_000_000), (1000.0, 4_000_000), (100.0, 1_000_000)):
        ctrl = make(2, anchor=10, **{**SLOW_LINK, "boundary_bytes": payload, "link_mbit_s": mbit_s})
        calibrate(ctrl, [5.0, 5.0])
        anchors[mbit_s, payload] = ctrl.anchor
    assert anchors[100.0, 4_000_000] > anchors[100.0, 1_000_000] > anchors[1000.0, 4_000_000] > 10


# --------------------------------------------------------------------------- shrink


def test_shrink_anchor_rescales_counts_ignoring_dead_zone():
    """Guards shrink the anchor; counts follow at once even for a change inside the dead zone."""
    ctrl = make(3, anchor=20)
    feed(ctrl, [100.0, 30.0, 70.0])
    assert ctrl.counts == [20, 67, 29]
    ctrl.shrink_anchor(0.97)  # 19.4 -> 19, only 5 % below: the dead zone must not keep 20
    assert ctrl.anchor == 19
    assert ctrl.counts == [19, round(19 * 100 / 30), round(19 * 100 / 70)]
    ctrl.shrink_anchor(0.5)
    assert ctrl.anchor == 9
    assert ctrl.counts == [9, 30, 13]


def test_shrink_anchor_never_below_one_and_may_pass_min_anchor():
    """Shrinking may go below min_anchor but never below one step."""
    ctrl = make(2, anchor=4, min_anchor=4)
    ctrl.shrink_anchor(0.5)
    assert ctrl.anchor == 2
    ctrl.shrink_anchor(0.1)
    assert ctrl.anchor == 1
    ctrl.shrink_anchor(0.5)
    assert ctrl.anchor == 1
    assert ctrl.counts == [1, 1]


def test_shrink_anchor_before_calibration_and_clears_proposal():
    """Before speeds exist counts are the anchor everywhere; a pending growth proposal is dropped."""
    ctrl = make(3, anchor=10)
    ctrl.shrink_anchor(0.5)
    assert ctrl.anchor == 5
    assert len(set(ctrl.counts)) == 1 and 1 <= ctrl.counts[0] <= 5
    ctrl = make(2, anchor=10)
    calibrate(ctrl, [10.0, 10.0], boundary_ms=[25.0, 25.0])
    feed(ctrl, [10.0, 10.0], windows=1, boundary_ms=[25.0, 25.0], growth_allowed=False)
    assert ctrl.proposed_anchor == 20
    ctrl.shrink_anchor(0.5)
    assert ctrl.proposed_anchor is None
    assert ctrl.anchor == 5


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, -0.5])
def test_shrink_anchor_rejects_bad_factor(factor):
    """A factor outside (0, 1) is not a shrink; it must be refused, not silently applied."""
    with pytest.raises(ValueError, match="shrink factor"):
        make(2).shrink_anchor(factor)


# --------------------------------------------------------------------------- window cap


def test_window_cap_scales_counts_down():
    """set_max_total_steps keeps the cohort's window within one epoch, shares kept roughly."""
    ctrl = make(3, anchor=10)
    calibrate(ctrl, [100.0, 30.0, 70.0])
    assert sum(ctrl.counts) == 57
    ctrl.set_max_total_steps(20)
    assert sum(ctrl.counts) == 20
    assert min(ctrl.counts) >= 1
    assert ctrl.counts[1] > ctrl.counts[2] > ctrl.counts[0]
    feed(ctrl, [100.0, 30.0, 70.0], windows=3)  # later plans honour the cap too
    assert sum(ctrl.counts) <= 20


def test_window_cap_not_binding_changes_nothing_and_none_lifts_it():
    """A cap above the total leaves counts as they are; None removes the cap for later plans."""
    ctrl = make(2, anchor=10)
    calibrate(ctrl, [10.0, 10.0])
    ctrl.set_max_total_steps(100)
    assert ctrl.counts == [10, 10]
    ctrl.set_max_total_steps(5)
    assert sum(ctrl.counts) == 5
    ctrl.set_max_total_steps(None)
    assert ctrl.max_total_steps is None
    feed(ctrl, [10.0, 10.0], windows=1)
    assert ctrl.counts == [10, 10]


def test_window_cap_below_world_size_still_gives_every_rank_a_step():
    """A cap smaller than the world size is raised to it: every rank must take part."""
    ctrl = make(4, anchor=10)
    ctrl.set_max_total_steps(2)
    assert ctrl.max_total_steps == 4
    assert ctrl.counts == [1, 1, 1, 1]


def test_window_cap_with_one_very_fast_rank():
    """Cap 20 with counts [640, 10, 10, 10]: the cap must hold while the slow ranks keep 1 step.

    Flooring the small counts to 0 and bumping them to 1 overshoots; the surplus has to be taken
    back from the large count. Expected sum 20, e.g. [17, 1, 1, 1].
    """
    ctrl = make(4, anchor=10)
    calibrate(ctrl, [10.0, 640.0, 640.0, 640.0])
    assert ctrl.counts == [640, 10, 10, 10]
    ctrl.set_max_total_steps(20)
    assert min(ctrl.counts) >= 1
    assert sum(ctrl.counts) <= 20, ctrl.counts


def test_window_cap_with_partition_ratios_at_world_size():
    """Cap == world size (tiny epoch) must give exactly one step each, whatever the ratios."""
    ctrl = make(4, anchor=1, partition_ratios=[64.0, 1.0, 1.0, 1.0])
    assert ctrl.counts == [64, 1, 1, 1]
    ctrl.set_max_total_steps(4)
    assert ctrl.counts == [1, 1, 1, 1]


# --------------------------------------------------------------------------- partition ratios / sync


def test_partition_ratios_pin_counts():
    """User-pinned ratios override measured speeds: counts stay anchor * ratio / smallest ratio."""
    ctrl = make(3, anchor=10, partition_ratios=[1.0, 2.0, 3.0])
    assert ctrl.anchor_rank == 0
    assert ctrl.counts == [10, 20, 30]
    feed(ctrl, [10.0, 100.0, 50.0], windows=6)  # speeds that contradict the ratios
    assert ctrl.anchor_rank == 0
    assert ctrl.counts == [10, 20, 30]


def test_partition_ratios_anchor_rank_and_cap():
    """The anchor rank is the smallest ratio (ties to the lower rank); ratios cap at 64."""
    ctrl = make(3, anchor=10, partition_ratios=[2.0, 1.0, 1.0])
    assert ctrl.anchor_rank == 1
    assert ctrl.counts == [20, 10, 10]
    ctrl = make(2, anchor=10, partition_ratios=[1.0, 100.0])
    assert ctrl.counts == [10, 640]


def test_partition_ratios_scale_with_anchor_growth_and_shrink():
    """Anchor tuning still applies under pinned ratios; the counts keep the ratios."""
    ctrl = make(3, anchor=10, partition_ratios=[1.0, 2.0, 3.0])
    calibrate(ctrl, [10.0, 10.0, 10.0], boundary_ms=[1000.0] * 3)
    assert ctrl.anchor == 10
    feed(ctrl, [10.0, 10.0, 10.0], windows=1, boundary_ms=[1000.0] * 3)
    assert ctrl.anchor == 20
    assert ctrl.counts == [20, 40, 60]
    ctrl.shrink_anchor(0.5)
    assert ctrl.counts == [10, 20, 30]
    fresh = make(3, anchor=10, partition_ratios=[1.0, 2.0, 3.0])
    fresh.shrink_anchor(0.5)  # before calibration too
    assert fresh.counts == [5, 10, 15]


def test_sync_policy_keeps_counts_all_one():
    """policy='sync' averages after every step: counts are 1 whatever the speeds or overhead."""
    ctrl = make(3, policy="sync", anchor=10)
    assert ctrl.anchor == 1
    assert ctrl.counts == [1, 1, 1]
    feed(ctrl, [100.0, 10.0, 50.0], windows=8, boundary_ms=[1000.0] * 3)
    assert ctrl.anchor == 1
    assert ctrl.counts == [1, 1, 1]
    assert ctrl.ms_per_step == pytest.approx([100.0, 10.0, 50.0])  # speeds still measured
    ctrl.shrink_anchor(0.5)
    assert ctrl.counts == [1, 1, 1]
    ctrl.set_max_total_steps(2)
    assert ctrl.counts == [1, 1, 1]


# --------------------------------------------------------------------------- checkpoint


def _trained_controller(world: int = 3) -> Controller:
    ctrl = make(world, anchor=10)
    speeds = [[100.0, 30.0, 70.0], [110.0, 31.0, 66.0], [95.0, 29.0, 72.0], [120.0, 33.0, 60.0]]
    for k in range(7):
        ms = speeds[k % len(speeds)][:world]
        ctrl.observe(report(ctrl, ms, [300.0 + k] * world), growth_allowed=k % 3 != 0)
    return ctrl


def test_state_dict_round_trip_restores_the_plan():
    """A checkpointed controller comes back with the same anchor, counts, election and speeds."""
    original = _trained_controller()
    state = original.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # checkpoints are loaded with weights_only=True
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    restored = make(3, anchor=10)
    restored.load_state_dict(state)
    assert restored.anchor == original.anchor > 10
    assert restored.counts == original.counts
    assert restored.anchor_rank == original.anchor_rank is not None
    assert restored.calibrations == original.calibrations
    assert restored.ms_per_step == original.ms_per_step
    assert restored.calibrated
    assert restored.state_dict() == original.state_dict()


def test_replicas_restored_from_one_checkpoint_decide_identically():
    """Every rank loads the same checkpoint and must keep agreeing on every later plan."""
    state = _trained_controller().state_dict()
    replicas = [make(3, anchor=10) for _ in range(3)]
    for replica in replicas:
        replica.load_state_dict(state)
    for k in range(8):
        ms = [90.0 + 5 * k, 30.0, 75.0 - k]
        rep = report(replicas[0], ms, [400.0, 400.0 + k, 450.0])
        for replica in replicas:
            replica.observe(rep, growth_allowed=k != 3)
        assert all(r.state_dict() == replicas[0].state_dict() for r in replicas)
        assert all(r.counts == replicas[0].counts and r.anchor == replicas[0].anchor for r in replicas)


def test_restored_controller_tracks_new_speeds_like_the_original():
    """After SPEED_WINDOW more windows the restored speed estimates equal the original's."""
    original = _trained_controller()
    restored = make(3, anchor=10)
    restored.load_state_dict(original.state_dict())
    for _ in range(SPEED_WINDOW + 1):
        rep = report(original, [80.0, 40.0, 60.0], [400.0] * 3)
        original.observe(rep)
        restored.observe(rep)
    assert restored.ms_per_step == pytest.approx(original.ms_per_step)
    assert restored.anchor_rank == original.anchor_rank


def test_state_dict_of_fresh_controller_round_trips():
    """anchor_rank None survives as -1 and comes back as None."""
    state = make(2, anchor=7).state_dict()
    assert state["anchor_rank"] == -1
    restored = make(2, anchor=3)
    restored.load_state_dict(state)
    assert restored.anchor_rank is None
    assert restored.anchor == 7
    assert restored.counts == state["counts"]
    assert not restored.calibrated


def test_load_state_dict_with_other_world_size_keeps_anchor_and_relearns():
    """Resuming on a different number of ranks keeps the tuned anchor and re-learns speeds.

    Until the new ranks are measured the counts are one-step probes, as at a fresh start.
    """
    original = _trained_controller()
    anchor = original.anchor
    assert anchor > 10

    restored = make(5, anchor=10)
    restored.load_state_dict(original.state_dict())
    assert restored.anchor == anchor
    assert restored.counts == [1] * 5
    assert restored.ms_per_step == [None] * 5
    assert restored.anchor_rank is None
    assert restored.calibrations == 0
    # The next window is a first calibration again: no growth on its warm-up reading.
    calibrate(restored, [10.0] * 5, boundary_ms=[1000.0] * 5)
    assert restored.anchor == anchor
    assert restored.counts == [anchor] * 5


def test_load_state_dict_with_other_world_size_keeps_partition_ratios():
    """Pinned partition_ratios must still shape the counts after a resume on another world size."""
    saved = make(2, anchor=10, partition_ratios=[1.0, 2.0]).state_dict()
    restored = make(3, anchor=10, partition_ratios=[1.0, 2.0, 3.0])
    restored.load_state_dict(saved)
    assert restored.counts == [10, 20, 30]


def test_sync_policy_stays_one_step_after_loading_a_cadence_checkpoint():
    """Resuming a cadence run with policy='sync' must still average after every single step."""
    cadence = make(2, anchor=10)
    feed(cadence, [100.0, 50.0], windows=3)
    assert cadence.counts == [10, 20]
    sync = make(2, policy="sync")
    sync.load_state_dict(cadence.state_dict())
    assert sync.anchor == 1
    assert sync.counts == [1, 1]


# --------------------------------------------------------------------------- split_by_weights


def test_split_by_weights_examples():
    """Largest remainder with ties to the lower rank: every rank computes the same split."""
    assert split_by_weights(10, [1, 1, 1]) == [4, 3, 3]
    assert split_by_weights(6, [1, 1, 1, 1]) == [2, 2, 1, 1]
    assert split_by_weights(10, [1, 3]) == [3, 7]  # 2.5 / 7.5: tie goes to rank 0
    assert split_by_weights(10, [3, 1]) == [8, 2]  # 7.5 / 2.5: rank 0 holds the larger part anyway
    assert split_by_weights(10, [2, 3, 5]) == [2, 3, 5]
    assert split_by_weights(0, [1, 2]) == [0, 0]


def test_split_by_weights_minimum_and_zero_weights():
    """The minimum is given first; all-zero weights split equally."""
    assert split_by_weights(10, [1, 0, 0], minimum=2) == [6, 2, 2]  # 10 proportional, then topped up
    assert split_by_weights(6, [5, 5, 5], minimum=2) == [2, 2, 2]
    assert split_by_weights(10, [0, 0]) == [5, 5]
    assert split_by_weights(7, [0, 0, 0]) == [3, 2, 2]
    assert split_by_weights(7, [0.0, 0.0, 0.0], minimum=1) == [3, 2, 2]


def test_split_by_weights_rejects_impossible_requests():
    """An empty split or a total below n * minimum is an error, not a silent short split."""
    with pytest.raises(ValueError, match="empty"):
        split_by_weights(5, [])
    with pytest.raises(ValueError, match="at least 2"):
        split_by_weights(5, [1, 1, 1], minimum=2)


@PROPERTY
@given(
    total=st.integers(0, 10_000),
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1e3)), min_size=1, max_size=16),
    minimum=st.integers(0, 5),
)
def test_split_by_weights_properties(total, weights, minimum):
    """Sum exact, minimum respected, parts proportional except where the minimum tops them up.

    A part above the minimum is within one of its exact share, less what it gave away to top
    up the parts whose share fell below the minimum.
    """
    n = len(weights)
    if total < minimum * n:
        with pytest.raises(ValueError):
            split_by_weights(total, weights, minimum)
        return
    parts = split_by_weights(total, weights, minimum)
    assert len(parts) == n
    assert sum(parts) == total
    assert all(p >= minimum for p in parts)
    wsum = sum(weights)
    exact = [total * w / wsum if wsum > 0 else total / n for w in weights]
    topped_up = sum(max(0.0, minimum - x) for x in exact) + n
    for part, x in zip(parts, exact):
        if part > minimum:
            assert x - topped_up - 1e-6 <= part <= x + 1 + 1e-6
    assert split_by_weights(total, list(weights), minimum) == parts  # deterministic


@PROPERTY
@given(total=st.integers(0, 1000), n=st.integers(1, 16))
def test_split_by_weights_equal_weights_favour_lower_ranks(total, n):
    """Equal weights: parts differ by at most one and the extras go to the lowest ranks."""
    parts = split_by_weights(total, [1.0] * n)
    assert parts == sorted(parts, reverse=True)
    assert max(parts) - min(parts) <= 1
    assert sum(parts) == total


# --------------------------------------------------------------------------- properties

world_sizes = st.integers(1, 16)


@st.composite
def speed_runs(draw, max_windows: int = 8):
    """A world size and per-window ms/step per rank, all within the 64x ratio cap."""
    world = draw(world_sizes)
    base = draw(st.lists(st.floats(1.0, 60.0), min_size=world, max_size=world))
    windows = draw(st.integers(1, max_windows))
    runs = []
    for _ in range(windows):
        jitter = draw(st.lists(st.floats(0.95, 1.05), min_size=world, max_size=world))
        runs.append([min(60.0, max(1.0, b * j)) for b, j in zip(base, jitter)])
    boundaries = draw(st.lists(st.floats(0.0, 500.0), min_size=windows, max_size=windows))
    return world, runs, boundaries


@PROPERTY
@given(run=speed_runs(), anchor=st.integers(1, 50))
def test_property_counts_proportional_to_speed(run, anchor):
    """After every window: counts >= 1 and |n_r - anchor * slow_ms / ms_r| <= 0.5 + 0.05 * n_r.

    The bound: a freshly computed count is round(exact), so within 0.5 of it; the dead zone may
    instead keep the current count when |target - current| <= 5 % of current, which adds at most
    DEAD_ZONE * n_r. On the first calibration there is no dead zone, so the bound is 0.5 there.
    Speeds stay in [1, 60] ms (ratio < 64 cap), no window cap, no max_batch_diff. The anchor
    still grows from the random boundary times, so the dead zone is exercised across anchor changes.
    """
    world, runs, boundaries = run
    ctrl = make(world, anchor=anchor, max_anchor=10_000)
    for ms, b in zip(runs, boundaries):
        ctrl.observe(report(ctrl, ms, [b] * world))
        assert all(c >= 1 for c in ctrl.counts)
        if ctrl.calibrations == 0:  # a start-up window may be skipped: no speed-based plan yet
            continue
        speeds = ctrl.ms_per_step
        slow = speeds[ctrl.anchor_rank]
        slack = 0.0 if ctrl.calibrations == 1 else DEAD_ZONE
        for n, m in zip(ctrl.counts, speeds):
            exact = ctrl.anchor * slow / m
            assert abs(n - exact) <= 0.5 + slack * n + 1e-9, (ctrl.counts, ctrl.anchor, speeds)
        # The anchor rank is within 10 % of the slowest rank, so nobody runs under ~anchor/1.1.
        assert slow * (1.0 + 0.10) >= max(speeds) - 1e-9


@PROPERTY
@given(run=speed_runs(), anchor=st.integers(1, 50), cap_extra=st.integers(0, 400))
def test_property_window_cap_never_exceeded(run, anchor, cap_extra):
    """With set_max_total_steps(cap) the cohort never plans more steps than the epoch has left."""
    world, runs, boundaries = run
    ctrl = make(world, anchor=anchor, max_anchor=10_000)
    cap = world + cap_extra
    ctrl.set_max_total_steps(cap)
    assert sum(ctrl.counts) <= cap
    for ms, b in zip(runs, boundaries):
        ctrl.observe(report(ctrl, ms, [b] * world))
        assert all(c >= 1 for c in ctrl.counts), ctrl.counts
        assert sum(ctrl.counts) <= cap, (ctrl.counts, cap)


@PROPERTY
@given(
    world=world_sizes,
    counts=st.lists(st.integers(1, 64 * 50), min_size=16, max_size=16),
    cap_extra=st.integers(0, 400),
)
def test_property_window_cap_on_any_ratio_plan(world, counts, cap_extra):
    """The cap holds for any pinned-ratio plan too (ratios within 64x), each rank keeping >= 1."""
    ratios = [float(c) for c in counts[:world]]
    ctrl = make(world, anchor=1, partition_ratios=ratios)
    cap = world + cap_extra
    ctrl.set_max_total_steps(cap)
    assert all(c >= 1 for c in ctrl.counts)
    assert sum(ctrl.counts) <= cap, (ctrl.counts, cap)


@PROPERTY
@given(run=speed_runs(), anchor=st.integers(1, 50), guard=st.lists(st.booleans(), min_size=8, max_size=8))
def test_property_same_inputs_same_plan(run, anchor, guard):
    """Two replicas fed identical reports agree on counts, anchor and anchor rank after every window."""
    world, runs, boundaries = run
    a = make(world, anchor=anchor)
    b = make(world, anchor=anchor)
    for k, (ms, bnd) in enumerate(zip(runs, boundaries)):
        rep = report(a, ms, [bnd * (1 + r / 10) for r in range(world)])
        a.observe(rep, growth_allowed=guard[k])
        b.observe(rep, growth_allowed=guard[k])
        assert a.counts == b.counts
        assert a.anchor == b.anchor
        assert a.anchor_rank == b.anchor_rank
        assert a.state_dict() == b.state_dict()
