"""The guard's verdicts applied to the replicated controller, one boundary at a time (no processes)."""

from __future__ import annotations

from lightning_elche.cohort.controller import Controller, ControllerConfig, WindowReport
from lightning_elche.cohort.governor import AnchorGovernor
from lightning_elche.cohort.guards import DivergenceReport, NoGuard, Verdict


class ScriptedGuard:
    """Answers a fixed sequence of verdicts and remembers what it was shown."""

    def __init__(self, actions: list[Verdict]) -> None:
        self.actions = list(actions)
        self.seen: list[DivergenceReport] = []

    def observe(self, report: DivergenceReport) -> Verdict:
        self.seen.append(report)
        return self.actions.pop(0) if self.actions else Verdict("stable")

    def state_dict(self) -> dict:
        return {"left": len(self.actions)}

    def load_state_dict(self, state: dict) -> None:
        self.actions = self.actions[-state["left"]:] if state["left"] else []


def calibrated_controller(anchor: int = 8) -> Controller:
    controller = Controller(ControllerConfig(world_size=2, anchor=anchor, min_anchor=1, max_anchor=64))
    for _ in range(3):  # warm-up window and probes: speeds of 10 and 20 ms per step
        controller.observe(WindowReport(window_ms=[10.0, 20.0], steps=[1, 1], boundary_ms=[0.0, 0.0]))
    return controller


def window(counts: list[int], boundary_ms: float) -> WindowReport:
    return WindowReport(window_ms=[10.0 * counts[0], 20.0 * counts[1]], steps=counts, boundary_ms=[boundary_ms] * 2)


def test_the_guard_judges_the_previous_window_with_its_steps_and_anchor():
    controller = calibrated_controller()
    guard = ScriptedGuard([])
    governor = AnchorGovernor(guard)
    governor.boundary(controller, window([16, 8], 1.0), previous_divergence=0.0, lr=0.1)
    anchor_then = controller.anchor
    governor.boundary(controller, window([16, 8], 1.0), previous_divergence=0.07, lr=0.1)
    first, second = guard.seen
    assert first.steps == 0  # nothing before the first window: the guard ignores it
    assert (second.divergence, second.steps, second.anchor, second.lr) == (0.07, 16, anchor_then, 0.1)


def test_suppress_holds_a_growth_the_overhead_asks_for():
    costly = 80.0  # a boundary costing as much as the window: the overhead tuning wants growth
    held, free = calibrated_controller(), calibrated_controller()
    held_governor = AnchorGovernor(ScriptedGuard([Verdict("suppress")] * 10))
    free_governor = AnchorGovernor(NoGuard())
    for _ in range(6):
        held_governor.boundary(held, window(held.counts, costly), 0.05, 0.1)
        free_governor.boundary(free, window(free.counts, costly), 0.05, 0.1)
    assert held.anchor == 8 < free.anchor


def test_nudge_shrinks_the_anchor_and_its_counts_at_once():
    controller = calibrated_controller()
    governor = AnchorGovernor(ScriptedGuard([Verdict("stable"), Verdict("nudge", 0.5)]))
    governor.boundary(controller, window(controller.counts, 0.5), 0.02, 0.1)
    before = controller.anchor
    governor.boundary(controller, window(controller.counts, 0.5), 0.3, 0.1)
    assert controller.anchor == before // 2
    assert controller.counts[1] == controller.anchor  # the slow rank runs the anchor


def test_an_lr_cliff_nudges_even_with_no_guard():
    controller = calibrated_controller()
    governor = AnchorGovernor(NoGuard())
    governor.boundary(controller, window(controller.counts, 0.5), 0.02, lr=0.1)
    before = controller.anchor
    verdict = governor.boundary(controller, window(controller.counts, 0.5), 0.02, lr=0.01)
    assert verdict.action == "nudge" and controller.anchor == before // 2


def test_state_round_trip():
    governor = AnchorGovernor(ScriptedGuard([Verdict("suppress")] * 3))
    controller = calibrated_controller()
    governor.boundary(controller, window([16, 8], 1.0), 0.0, 0.1)
    restored = AnchorGovernor(ScriptedGuard([Verdict("suppress")] * 3))
    restored.load_state_dict(governor.state_dict())
    assert restored.state_dict() == governor.state_dict()
