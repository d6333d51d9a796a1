"""The cohort core without processes: several ranks' Cohort objects driven batch by batch, their
reports combined as the boundary all-reduce would, every rank reaching the same decisions."""

from __future__ import annotations

import signal

import pytest

from lightning_elche.cohort.control import LocalReport, gather_reports
from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.limits import FitLimits
from lightning_elche.cohort.guards import NoGuard
from lightning_elche.cohort.train_data import TrainData

SAMPLES = 960
BATCH = 8


def make_cohort(world: int = 2, **kwargs) -> list[Cohort]:
    config = kwargs.pop("config", None) or ControllerConfig(world_size=world, anchor=4, min_anchor=4)
    limit_names = ("max_steps", "min_steps", "step_checkpoint_every", "time_limits_s")
    limits = FitLimits(**{name: tuple(v) if isinstance(v, list) else v for name, v in kwargs.items() if name in limit_names})
    kwargs = {name: value for name, value in kwargs.items() if name not in limit_names}
    cohorts = [Cohort(config, NoGuard(), rank=rank, limits=limits, **kwargs) for rank in range(world)]
    for cohort in cohorts:
        cohort.set_train_data(TrainData(SAMPLES, seed=3, shuffle=True, batch_size=BATCH, samples_per_step=BATCH,
                                        drop_last=False), lookahead_batches=1)
    return cohorts


def exchange(reports: list[LocalReport]) -> object:
    """What the boundary all-reduce returns: every rank's fields in its slot, flags OR-ed."""
    fields = [dict(r.fields, steps=r.steps, weight=float(r.steps), moved=float(r.steps > 0)) for r in reports]
    return gather_reports(fields, [r.flags for r in reports])


def run_window(cohorts: list[Cohort], ms_per_batch: list[float], trained: list[list[int]] | None = None):
    """Every rank trains its batches of the current window, then all meet at the boundary."""
    clock = [0.0] * len(cohorts)
    for rank, cohort in enumerate(cohorts):
        plan, window = cohort.plan, cohort.clock.window
        if trained is not None:
            trained[rank].extend(plan.indices(window, rank).tolist())
        cohort.start_clock(clock[rank])
        while True:
            cohort.batch_started()
            cohort.optimizer_stepped()
            clock[rank] += ms_per_batch[rank] / 1000.0
            if cohort.batch_ended(clock[rank], last_batch=False):
                break
    control = exchange([c.local_report() for c in cohorts])
    outcomes = [c.boundary(control, divergence=0.0, averaged=True) for c in cohorts]
    records = [c.close_boundary(1.0) for c in cohorts]
    return outcomes, records


def run_epoch(cohorts, ms_per_batch, epoch=0, trained=None):
    for cohort in cohorts:
        cohort.begin_epoch(epoch)
    results = []
    plan = cohorts[0].plan
    while not (plan.complete and cohorts[0].clock.window >= len(plan.sizes)):
        results.append(run_window(cohorts, ms_per_batch, trained))
    return results


def test_every_rank_decides_the_same_and_every_sample_is_trained_once():
    cohorts = make_cohort(2)
    trained: list[list[int]] = [[], []]
    results = run_epoch(cohorts, [10.0, 30.0], trained=trained)
    for outcomes, records in results:
        assert outcomes[0] == outcomes[1]
        assert {k: v for k, v in records[0].__dict__.items() if k != "divergence"} == {
            k: v for k, v in records[1].__dict__.items() if k != "divergence"
        }
    assert sorted(trained[0] + trained[1]) == list(range(SAMPLES))
    assert not set(trained[0]) & set(trained[1])
    # rank 0 is three times faster: after the probes it gets three times the steps
    assert results[-2][1][0].steps == [12, 4]
    total = sum(sum(records[0].steps) for _, records in results)
    assert cohorts[0].cohort_step == total // 2 == results[-1][0][0].cohort_step


def test_max_steps_lands_exactly_and_is_reported_once():
    cohorts = make_cohort(2, max_steps=23)
    for cohort in cohorts:
        cohort.begin_epoch(0)
    reached = []
    for _ in range(40):
        outcomes, _ = run_window(cohorts, [10.0, 20.0])
        reached.append(outcomes[0].max_steps_reached)
        if outcomes[0].max_steps_reached:
            break
    assert reached[-1] and not any(reached[:-1])
    assert cohorts[0].cohort_step == cohorts[1].cohort_step == 23


def test_a_stop_asked_on_one_rank_stops_every_rank_once_min_steps_is_met():
    cohorts = make_cohort(2, min_steps=30)
    for cohort in cohorts:
        cohort.begin_epoch(0)
    cohorts[1].requests.request_stop()
    stops = []
    while not stops or not stops[-1]:
        outcomes, _ = run_window(cohorts, [10.0, 10.0])
        assert outcomes[0].should_stop == outcomes[1].should_stop
        stops.append(outcomes[0].should_stop)
    assert cohorts[0].cohort_step >= 30
    assert len(stops) > 1  # held while min_steps was unmet
    assert not cohorts[0].requests.stop and not cohorts[1].requests.stop


def test_sigterm_and_requeue_on_one_rank_reach_every_rank_at_the_next_boundary():
    cohorts = make_cohort(2)
    for cohort in cohorts:
        cohort.begin_epoch(0)
    cohorts[0].requests.received_sigterm()
    cohorts[1].requests.received_requeue(signal.SIGUSR2)
    outcomes, _ = run_window(cohorts, [10.0, 10.0])
    assert [o.sigterm for o in outcomes] == [True, True]
    assert [o.requeue_signal for o in outcomes] == [signal.SIGUSR1, signal.SIGUSR2]
    outcomes, _ = run_window(cohorts, [10.0, 10.0])
    assert [o.requeue_signal for o in outcomes] == [None, None]


def test_checkpoints_only_at_boundaries_with_exact_coverage():
    cohorts = make_cohort(2)
    trained: list[list[int]] = [[], []]
    for cohort in cohorts:
        cohort.begin_epoch(0)
    for _ in range(5):
        run_window(cohorts, [10.0, 20.0], trained)
    point = cohorts[0].resume_point(optimizer_states=lambda: None, outer=None)
    assert point is not None and point.cohort_steps_total == cohorts[0].cohort_steps_total
    covered = cohorts[0].data.samples_at(0, point.covered)
    assert sorted(covered.tolist()) == sorted(trained[0] + trained[1])
    assert len(point.covered.pairs) == 1  # planned windows cover a prefix of the order: one span
    cohorts[0].batch_started()
    with pytest.raises(RuntimeError, match="checkpoints are taken at window boundaries"):
        cohorts[0].resume_point(optimizer_states=lambda: None, outer=None)


def test_a_resumed_cohort_trains_only_what_is_left():
    cohorts = make_cohort(2)
    trained: list[list[int]] = [[], []]
    for cohort in cohorts:
        cohort.begin_epoch(0)
    for _ in range(6):
        run_window(cohorts, [10.0, 20.0], trained)
    point = cohorts[0].resume_point(optimizer_states=lambda: None, outer=None)
    resumed = make_cohort(3, config=ControllerConfig(world_size=3, anchor=4, min_anchor=4), resume=point)
    assert resumed[0].cohort_step == cohorts[0].cohort_step
    after: list[list[int]] = [[], [], []]
    run_epoch(resumed, [10.0, 20.0, 30.0], trained=after)
    before = trained[0] + trained[1]
    assert sorted(before + sum(after, [])) == list(range(SAMPLES))


def test_disagreeing_plans_and_an_all_non_finite_cohort_raise_on_every_rank():
    cohorts = make_cohort(2)
    for cohort in cohorts:
        cohort.begin_epoch(0)
    reports = []
    for cohort in cohorts:
        cohort.batch_started()
        cohort.optimizer_stepped()
        cohort.batch_ended(0.01, last_batch=False)
        reports.append(cohort.local_report())
    forged = reports[1].fields | {"fingerprint": reports[1].fields["fingerprint"] + 1}
    control = exchange([reports[0], LocalReport(reports[1].steps, forged, reports[1].flags)])
    for cohort in cohorts:
        with pytest.raises(RuntimeError, match="disagree on the plan"):
            cohort.boundary(control, 0.0, True)
    control = gather_reports([dict(r.fields, steps=r.steps, nonfinite=1.0) for r in reports])
    for cohort in cohorts:
        with pytest.raises(FloatingPointError, match="every rank has non-finite parameters"):
            cohort.boundary(control, 0.0, False)


def test_consensus_is_needed_at_the_epoch_end_on_flags_and_on_checkpoint_crossings():
    cohorts = make_cohort(2, step_checkpoint_every=[7])
    cohort = cohorts[0]
    cohort.begin_epoch(0)
    quiet = exchange([LocalReport(1, {}, {}), LocalReport(1, {}, {})])
    assert not cohort.needs_consensus(quiet)
    assert cohort.needs_consensus(exchange([LocalReport(1, {}, {"stop": True}), LocalReport(1, {}, {})]))
    assert cohort.needs_consensus(exchange([LocalReport(7, {}, {}), LocalReport(7, {}, {})]))


def test_logger_positions_spread_over_the_window_and_are_exact_at_boundaries():
    cohorts = make_cohort(2, config=ControllerConfig(world_size=2, partition_ratios=[3.0, 1.0], anchor=2))
    for cohort in cohorts:
        cohort.begin_epoch(0)
    fast, slow = cohorts
    positions = []
    fast.start_clock(0.0)
    while True:
        logged, schedule = fast.batch_started()
        positions.append((logged, schedule))
        fast.optimizer_stepped()
        if fast.batch_ended(0.0, last_batch=False):
            break
    assert [p[0] for p in positions] == sorted(p[0] for p in positions)
    assert positions[0] == (0, 0) and positions[-1][1] < 4  # never past the window's end (8 steps / 2 ranks)
    slow.start_clock(0.0)
    while True:
        slow.batch_started()
        slow.optimizer_stepped()
        if slow.batch_ended(0.0, last_batch=False):
            break
    control = exchange([fast.local_report(), slow.local_report()])
    outcomes = [c.boundary(control, 0.0, True) for c in cohorts]
    assert outcomes[0].cohort_step == outcomes[1].cohort_step == 4
    assert outcomes[0].logger_step == 4 - 1  # Lightning adds the batch that just stepped


def test_a_dataloader_that_ends_inside_a_window_is_named():
    cohort = make_cohort(2, config=ControllerConfig(world_size=2, partition_ratios=[3.0, 1.0], anchor=2))[0]
    cohort.begin_epoch(0)
    cohort.batch_started()
    with pytest.raises(RuntimeError, match="ended inside window 0 of epoch 0 after 1 of 6 batches"):
        cohort.batch_ended(0.0, last_batch=True)


def test_the_lr_cliff_watcher_follows_rank_0s_lr_on_every_rank():
    """Under dynamic dispatch each rank's step schedules run on its own estimate of the cohort's
    progress, so the LRs the ranks report may differ; the anchor must still shrink on all or none."""
    cohorts = make_cohort(2)
    for cohort in cohorts:
        cohort.begin_epoch(0)

    def boundary(lrs: list[float]) -> list[int]:
        for rank, cohort in enumerate(cohorts):
            cohort.start_clock(0.0)
            while True:
                cohort.batch_started()
                cohort.optimizer_stepped()
                if cohort.batch_ended(0.01 * (rank + 1), last_batch=False):
                    break
        control = exchange([c.local_report(lr=lr) for c, lr in zip(cohorts, lrs)])
        for cohort in cohorts:
            cohort.boundary(control, divergence=0.0, averaged=True)
            cohort.close_boundary(1.0)
        return [c.controller.anchor for c in cohorts]

    for _ in range(3):
        boundary([0.1, 0.1])
    anchor = cohorts[0].controller.anchor
    assert boundary([0.1, 0.01]) == [anchor, anchor]  # rank 1's schedule ran ahead: no cliff for the cohort
    assert [r.verdict for r in cohorts[1].history[-1:]] == ["stable"]
    assert boundary([0.01, 0.01]) == [anchor // 2, anchor // 2]  # rank 0's LR fell off the cliff: both halve
    assert [c.history[-1].verdict for c in cohorts] == ["nudge", "nudge"]


def test_joiners_wait_at_an_epochs_last_boundary():
    """Admitted there, a joiner would start the next epoch while the members validate and checkpoint this one."""
    from lightning_elche.cohort.membership import closed_its_epoch

    cohorts = make_cohort(2)
    for cohort in cohorts:
        cohort.begin_epoch(0)
    closed = []
    plan = cohorts[0].plan
    while not (plan.complete and cohorts[0].clock.window >= len(plan.sizes)):
        run_window(cohorts, [10.0, 20.0])
        closed.append(closed_its_epoch(cohorts[0]))
    assert len(closed) > 2 and closed[-1] and not any(closed[:-1])
