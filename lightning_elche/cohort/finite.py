"""What a boundary does about ranks whose parameters are not finite (NaN or inf after a bad step)."""

from __future__ import annotations

import warnings
from typing import Optional, Sequence


def check_finite(nonfinite: Sequence[int], averaged: bool, rank: int, where: str, checkpoint: Optional[str]) -> None:
    """Every rank non-finite: stop, naming the checkpoint to resume from. Some ranks: they were left out of
    the average and reset to the consensus, which the lowest finite rank reports once."""
    bad = [r for r, flag in enumerate(nonfinite) if flag]
    if not bad:
        return
    if len(bad) == len(nonfinite):
        raise FloatingPointError(
            f"ElChe: every rank has non-finite parameters at {where}; training stops. The parameters were reset "
            "to the last consensus, and the last consensus checkpoint is "
            f"{checkpoint if checkpoint else 'none (no checkpoint was written yet)'}. "
            "Lower the learning rate or enable gradient clipping before resuming."
        )
    if averaged and rank == min(r for r in range(len(nonfinite)) if r not in bad):
        warnings.warn(
            f"ElChe: rank(s) {bad} had non-finite parameters at {where}; they were left out of the average "
            "and reset to the consensus",
            RuntimeWarning,
            stacklevel=4,
        )
