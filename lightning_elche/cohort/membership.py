"""An elastic cohort's membership changes, decided: where the next generation resumes the epoch.

The generations themselves (who is in, which rank each member has) are
:class:`~lightning_elche.cohort.control.Generation`, the vocabulary ``comm/membership.py`` agrees on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from lightning_elche.cohort.claims import Claims
from lightning_elche.cohort.control import CohortControl, Generation
from lightning_elche.cohort.controller import controller_state_for
from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.records import BoundaryRecord
from lightning_elche.cohort.resume import ResumePoint

if TYPE_CHECKING:
    from lightning_elche.cohort.core import Cohort


def survivors_point(
    cohort: "Cohort", survivors: Sequence[int], steps: int, logged: int, at_boundary: Sequence[Claims] = (),
    trained_since: Sequence[int] = (),
) -> ResumePoint:
    """The cohort's state once the ``survivors`` (ranks of the old generation) have averaged the window
    they just finished, ``steps`` optimizer steps and ``logged`` logged batches among them: what a
    checkpoint at this boundary would record had the lost ranks never started their window. The next
    generation resumes from it in memory, so the lost ranks' samples of the window go back to the epoch.
    Under dynamic dispatch the epoch needs every rank's claims at the last boundary (``at_boundary``) and
    the tickets the survivors trained since (``trained_since``); a planned epoch knows every piece.
    """
    plan, data = cohort.plan, cohort.data
    if plan is None or plan.total_steps is None or data is None or data.num_samples is None:
        raise RuntimeError("ElChe can continue without a lost rank only inside an epoch of known length")
    return ResumePoint(
        epoch=plan.epoch,
        num_samples=data.num_samples,
        covered=plan.covered_after_loss(cohort.clock.window, survivors, at_boundary, trained_since),
        seed=data.seed,
        world_size=cohort.world_size,
        cohort_steps_total=cohort.cohort_steps_total + steps,
        logged_steps_total=cohort.logged_steps_total + logged,
        controller=controller_state_for(cohort.controller.state_dict(), survivors),
        governor=cohort.governor.state_dict(),
    )


def membership_record(
    old: "Cohort", control: CohortControl, divergence: float, cohort_step: int, generation: Generation
) -> BoundaryRecord:
    """The boundary at which the survivors of the last generation averaged their window, as the
    history shows it (``level="membership"``; the counts are the new generation's first plan)."""
    plan = old.plan
    assert plan is not None
    return BoundaryRecord(
        epoch=plan.epoch,
        window=old.clock.window,
        steps=control.ints("steps"),
        samples=control.ints("samples"),
        window_ms=list(control.per_rank["window_ms"]),
        boundary_ms=0.0,
        anchor=old.controller.anchor,
        counts=[],
        cohort_step=cohort_step,
        divergence=divergence,
        cohort_divergence=0.0,
        cohort_divergence_mean=0.0,
        verdict="stable",
        level=f"membership:{generation.number}",
    )


def covers_its_epoch(point: ResumePoint) -> bool:
    """Whether ``point`` is at its epoch's end (every sample of it trained)."""
    return isinstance(point.covered, Spans) and point.covered.size >= point.num_samples


def closed_its_epoch(cohort: "Cohort") -> bool:
    """Whether the boundary just run closed the epoch's last window. Joiners wait for the next epoch's
    first boundary: admitted here, they would start in the next epoch while the members run this one's
    validation and checkpoint, whose collectives would then wait for them until the timeout."""
    plan = cohort.plan
    return plan is not None and plan.complete and cohort.clock.window >= plan.window_count
