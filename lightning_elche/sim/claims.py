"""Dynamic dispatch in the simulator: how a window's pool splits across ranks, and what claims cost.

The pool of ``P`` one-step tickets drains at the cohort's combined rate, so rank r trains about
``rate_r * t`` steps where ``t = P / sum(rates)``, and always at least the one it started with; the
last tickets go to the ranks that finish them soonest (``split_pool``).

Claims are not free. Each chunk of ``c`` tickets costs a store operation (plus, about once a
window, the read that tells a rank the pool drained), a network round trip plus the time it
queues at the store's one server. A rank sends each claim as it starts the last step it holds
(``Claiming.ahead``), so a step's worth of that is hidden: it waits ``max(0, operation - step)``.
With every rank claiming, the server is an M/D/1 queue: at utilisation ``rho`` an operation waits
``rho * s / (2 * (1 - rho))`` for a service time ``s``. Ranks size their chunks as in training
(``cohort.pool.claim_chunk``), which lowers ``rho``; the fixed point of the two is found by
iterating. Past saturation the store caps the cohort at ``c / s`` steps per ms and the steps
stretch accordingly.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_elche.cohort.claims import claim_chunk, faster_per_own_step, leaves_to_the_faster

STORE_OPS_PER_CHUNK = 1  # the claim (the read that notices a drained pool comes about once a window)
FIXED_POINT_ROUNDS = 8


@dataclass(frozen=True)
class ClaimCost:
    """Per-step claiming cost on each rank, and the store's load."""

    ms_per_step: tuple[float, ...]  # added to each rank's step
    chunks: tuple[int, ...]
    utilisation: float  # of the store's server (>= 1: saturated)


def claim_costs(
    step_ms: Sequence[float], window_ms: Optional[float], round_trip_ms: float, store_op_ms: float
) -> ClaimCost:
    """What claiming adds to each rank's step, with ``len(step_ms)`` ranks sharing one store."""
    if round_trip_ms <= 0 and store_op_ms <= 0:
        return ClaimCost(tuple(0.0 for _ in step_ms), tuple(1 for _ in step_ms), 0.0)
    wait = 0.0
    chunks = [1] * len(step_ms)
    rho = 0.0
    for _ in range(FIXED_POINT_ROUNDS):
        op_ms = round_trip_ms + store_op_ms + wait
        chunks = [claim_chunk(op_ms, ms, window_ms) for ms in step_ms]
        per_step = [STORE_OPS_PER_CHUNK * max(0.0, op_ms - ms) / c for c, ms in zip(chunks, step_ms)]
        ops_per_ms = sum(STORE_OPS_PER_CHUNK / (c * (ms + extra)) for c, ms, extra in zip(chunks, step_ms, per_step))
        rho = ops_per_ms * store_op_ms
        wait = math.inf if rho >= 1 else rho * store_op_ms / (2 * (1 - rho))
        if math.isinf(wait):
            break
    if rho >= 1:  # saturated: the store serves 1 / store_op_ms operations per ms, shared by demand
        demand = [STORE_OPS_PER_CHUNK / (c * ms) for c, ms in zip(chunks, step_ms)]
        stretch = sum(demand) * store_op_ms
        per_step = [ms * (stretch - 1) + STORE_OPS_PER_CHUNK * max(0.0, round_trip_ms - ms) / c for c, ms in zip(chunks, step_ms)]
    return ClaimCost(tuple(per_step), tuple(chunks), rho)


def split_pool(pool: int, step_ms: Sequence[float]) -> list[int]:
    """Steps each rank trains of a ``pool`` of tickets (at least one each), ranks claiming as they go.

    Every rank claims a ticket as it starts a step, in time order, and trains what it claimed; a
    rank much slower than others stops claiming once so few tickets are left that it leaves them to
    the faster ones, by training's own rule (``cohort.pool.leaves_to_the_faster``). The fastest rank
    claims until the pool is drained.
    """
    world = len(step_ms)
    if pool <= world:
        return [1] * world
    leaves = [leaves_to_the_faster(m) for m in faster_per_own_step([1.0 / ms for ms in step_ms])]
    counts = [1] * world
    left = pool - world
    upcoming = [(step_ms[rank], rank) for rank in range(world)]
    heapq.heapify(upcoming)
    while left > 0:
        at, rank = heapq.heappop(upcoming)
        if left < leaves[rank]:
            continue  # it closes its window: the rest is the faster ranks'
        counts[rank] += 1
        left -= 1
        heapq.heappush(upcoming, (at + step_ms[rank], rank))
    return counts
