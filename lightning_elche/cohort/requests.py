"""Requests a rank receives between boundaries, which the next boundary decides for every rank.

SIGTERM (preemption), SLURM's requeue signal and a stop (``trainer.should_stop``: EarlyStopping,
``max_time``) arrive on one rank at its own moment, mid-window. Acting on them there would stop that
rank alone and leave the others waiting at the next boundary; so the rank records them, carries them
in its flags to the next boundary, and every rank acts on what any rank carried, at the same boundary.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

from lightning_elche.cohort.control import CohortControl


@dataclass
class PendingRequests:
    """This rank's requests waiting for a boundary; they outlive a membership change."""

    sigterm: bool = False
    stop: bool = False
    requeue_signal: Optional[int] = None  # SLURM's requeue signal

    def request_stop(self) -> None:
        """A stop asked mid-window (``trainer.should_stop``)."""
        self.stop = True

    def received_sigterm(self) -> None:
        self.sigterm = True

    def received_requeue(self, signum: int) -> None:
        self.requeue_signal = signum

    def flags(self) -> dict[str, bool]:
        """What the boundary's control data carries of them."""
        return {"sigterm": self.sigterm, "stop": self.stop, "requeue": self.requeue_signal is not None}

    def take(self, control: CohortControl, time_is_up: bool, may_stop: bool) -> tuple[Optional[int], bool]:
        """The requests some rank carried to this boundary, decided for all: SLURM's requeue signal (a rank
        that did not get it uses SIGUSR1), and whether to stop now (asked, or ``max_time`` up, once
        ``may_stop``: ``min_steps`` met; until then the stop waits)."""
        requeue = None
        if control.flags["requeue"]:
            requeue, self.requeue_signal = self.requeue_signal or signal.SIGUSR1, None
        if control.flags["stop"] or time_is_up:
            self.stop = True
        should_stop = self.stop and may_stop
        if should_stop:
            self.stop = False
        return requeue, should_stop
