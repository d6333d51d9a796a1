"""Where the convergence guards meet the controller, once per boundary, on every rank alike.

A boundary's payload carries each rank's drift from the *previous* boundary's consensus (a rank
only knows its drift after the average), so the guard judges window b−1 at boundary b: the
divergence, the most steps any rank ran in that window and the anchor it ran with. The verdict
then decides whether the controller may commit a proposed anchor growth ("stable"), must hold it
("suppress"), or shrinks the anchor now ("nudge"). An LR cliff nudges too.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_elche.cohort.controller import Controller, WindowReport
from lightning_elche.cohort.guards import ConvergenceGuard, DivergenceReport, LrDropWatcher, Verdict, combine


class AnchorGovernor:
    """Runs the guard and the LR watcher on replicated inputs and applies the combined verdict."""

    def __init__(self, guard: ConvergenceGuard, lr_watcher: Optional[LrDropWatcher] = None) -> None:
        self.guard = guard
        self.lr_watcher = lr_watcher if lr_watcher is not None else LrDropWatcher()
        self._previous_steps = 0
        self._previous_anchor = 0

    def boundary(
        self, controller: Controller, window: WindowReport, previous_divergence: float, lr: Optional[float]
    ) -> Verdict:
        """Judge the previous window, let the controller plan the next one under that verdict.

        ``lr`` is one LR for the whole cohort (rank 0's, from the control data; None or NaN without
        an optimizer): each rank's own could differ where step schedules follow a local estimate.
        """
        report = DivergenceReport(
            divergence=previous_divergence if math.isfinite(previous_divergence) else math.nan,
            steps=self._previous_steps,
            anchor=self._previous_anchor,
            lr=lr,
        )
        verdict = combine(self.guard.observe(report), self.lr_watcher.observe(report))
        self._previous_steps, self._previous_anchor = max(window.steps), controller.anchor
        controller.observe(window, growth_allowed=verdict.action == "stable")
        if verdict.action == "nudge":
            controller.shrink_anchor(verdict.factor)
        return verdict

    def state_dict(self) -> dict[str, Any]:
        return {
            "guard": self.guard.state_dict(),
            "lr_watcher": self.lr_watcher.state_dict(),
            "previous": [self._previous_steps, self._previous_anchor],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state["guard"])
        self.lr_watcher.load_state_dict(state["lr_watcher"])
        self._previous_steps, self._previous_anchor = (int(v) for v in state["previous"])
