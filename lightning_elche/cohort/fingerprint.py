"""What every rank's epoch plan must agree on, as numbers the boundary's all-reduce carries exactly.

Each rank builds the epoch's plan on its own from its own train DataLoader; nothing is broadcast.
If two ranks build different plans they hand out different samples and, sooner or later, run
different numbers of batches, and a collective pairs up wrongly or never. So every boundary
carries, per rank:

- ``plan_samples``: the training set's length, ``plan_seed``: the sampler seed (both exact when
  below 2**24, capped above, so the error can name them);
- ``plan_data``: a hash of everything else the plan is built from (full seed and length, batch
  size, samples per optimizer step, drop_last, shuffle) and of the epoch's order itself (computed
  once per plan: another torch version or a resume from another checkpoint changes it);
- ``fingerprint``: a hash of the epoch, the window count and every frozen window's pieces, updated
  window by window as they are frozen.

The control region is all-reduced in the flat buffer's dtype, float32 for an fp32 model, where
integers are exact only below 2**24: every field is a 24-bit integer (hashes are taken modulo the
largest prime below 2**24), and each rank's value sits alone in its slot, so the SUM is exact.
A real difference escapes only if every field that differs collides, about 2**-24 for each.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from lightning_elche.cohort.control import CohortControl

MODULUS = 16_777_213  # the largest prime below 2**24
CAP = (1 << 24) - 1  # plan_seed / plan_samples at or above it read "CAP or more"
FINGERPRINT_FIELDS = ("fingerprint", "plan_data", "plan_seed", "plan_samples")


def digest(*parts: object, previous: bytes = b"") -> bytes:
    """An 8-byte digest of ``parts`` (numbers, strings, bytes) chained after ``previous``; the same on every rank."""
    h = hashlib.blake2b(previous, digest_size=8)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"|")
    return h.digest()


def to_field(value: bytes) -> int:
    """A digest as a 24-bit integer: exact in float32."""
    return int.from_bytes(value, "little") % MODULUS


def capped(value: Optional[int]) -> int:
    return 0 if value is None else min(value, CAP) if value >= 0 else CAP


def data_fields(
    *, seed: Optional[int], num_samples: int, shuffle: Optional[bool], batch_size: int, samples_per_step: int,
    drop_last: bool, order: Optional[bytes],
) -> dict[str, float]:
    """The plan's per-epoch fields: what the plan is built from, and the digest of the order it came to."""
    built_from = digest(seed, num_samples, shuffle, batch_size, samples_per_step, drop_last, order or b"no order")
    return {
        "plan_data": float(to_field(built_from)),
        "plan_seed": float(capped(seed)),
        "plan_samples": float(capped(num_samples)),
    }


def _by_value(values: Sequence[int], unit: str = "") -> str:
    """``[96, 97, 96]`` -> "96 on ranks 0, 2; 97 on rank 1" (a value at the cap: "16777215 or more")."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in list(groups.items())[:6]:
        shown = f"{value}{' or more' if value >= CAP else ''}{unit}"
        listed = ", ".join(str(rank) for rank in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
        parts.append(f"{shown} on rank{'s' if len(ranks) > 1 else ''} {listed}")
    return "; ".join(parts) + ("; ..." if len(groups) > 6 else "")


def check_fingerprints(control: CohortControl, epoch: int, window: int) -> None:
    """Raise on every rank alike (they all hold the same control data) when their plans differ, naming what differs."""
    fields = {name: control.ints(name) for name in FINGERPRINT_FIELDS if name in control.per_rank}
    differ = [name for name, values in fields.items() if len(set(values)) > 1]
    if not differ:
        return
    where = f"ElChe ranks disagree on the plan of epoch {epoch} window {window}"
    if "plan_samples" in differ:
        what = (
            f"their training sets have different lengths ({_by_value(fields['plan_samples'], ' samples')}). Every "
            "rank must build the same train dataset (the same files, filters and split), as DDP also assumes"
        )
    elif "plan_seed" in differ:
        what = (
            f"they shuffle with different sampler seeds ({_by_value(fields['plan_seed'])}). Call "
            "`seed_everything(seed)` with the same seed on every rank, or pass `ElCheStrategy(seed=...)`"
        )
    elif "plan_data" in differ:
        what = (
            "their train DataLoaders differ in batch_size, accumulate_grad_batches, drop_last, shuffle or a seed "
            "or length above 2**24, or their epoch orders differ (another torch version on some rank, or ranks "
            "resumed from different checkpoints). Give every rank the same DataLoader, software and checkpoint"
        )
    else:
        what = (
            f"they froze different windows (fingerprints: {_by_value(fields['fingerprint'])}): the train "
            "DataLoaders' num_workers and prefetch_factor, and Trainer(max_steps), must match on every rank"
        )
    raise RuntimeError(f"{where}: {what}. Every rank stops here, at the same boundary.")
