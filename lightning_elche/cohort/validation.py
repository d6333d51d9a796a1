"""How validation is split over the ranks: by speed, so that the fast ranks do not wait for the slow one.

Under DDP every rank validates an equal share (DistributedSampler, padded with repeats), so at every
validation the fast ranks wait for the slowest at the metrics' reduce. Here each rank validates a
contiguous share of the set proportional to its speed, in batches of the DataLoader's size: a faster
rank runs more of them. Lightning's epoch metrics weigh each batch by its size, and the reduce divides
the ranks' summed values by their summed sizes, so a mean over unequal shares is the mean over every
sample, once (no padding).

Ranks with unequal batch counts cannot pair a collective called on every validation step (a metric
logged with ``sync_dist=True`` and ``on_step=True``): the adapter splits by speed only after a first
validation with equal batch counts (DDP's count on every rank: :func:`even_batches`) called none.
"""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_elche.cohort.controller import split_by_weights


def speed_counts(num_samples: int, world_size: int, ms: Sequence[Optional[float]]) -> list[int]:
    """Samples each rank validates: proportional to its speed (1 / ``ms``, its ms per validation sample, or
    per training step before its validation was timed), at least one (every rank logs the same metrics,
    so every rank runs a batch); equal while a speed is unknown."""
    if any(value is None or value <= 0 for value in ms):
        return split_by_weights(num_samples, [1.0] * world_size, minimum=1)
    return split_by_weights(num_samples, [1.0 / value for value in ms if value is not None], minimum=1)


def even_batches(count: int, batches: int) -> list[int]:
    """``count`` samples in ``batches`` batches whose sizes differ by one at most (the probe's: DDP's number
    of batches on every rank, ``limits.ddp_batches_per_rank``, over each rank's unpadded share)."""
    size, extra = divmod(count, batches)
    return [size + 1] * extra + [size] * (batches - extra)
