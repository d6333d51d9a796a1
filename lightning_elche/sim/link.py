"""The simulated link: what a boundary and a DDP step cost on it, and telling the controller about it.

:func:`~lightning_elche.sim.simulator.simulate_cohort` charges each boundary the ring all-reduce of
ElChe's payload and each DDP step that of the model's gradients, with the same
:func:`~lightning_elche.cohort.link.link_ms` the controller sizes its anchor with; so the
simulator predicts the anchor a run on that link would choose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.link import link_ms


def simulated_costs(
    world: int,
    boundary_ms: float,
    boundary_ms_per_rank: float,
    allreduce_ms: Optional[float],
    link_mbit_s: Optional[float] = None,
    link_latency_ms: float = 0.0,
    boundary_bytes: int = 0,
    model_bytes: Optional[int] = None,
) -> tuple[float, float]:
    """(ElChe's boundary cost, DDP's all-reduce per step) in ms, as ``simulate_cohort`` charges them.

    Both pay the fixed and per-rank costs; on a link, ElChe adds the reduce of its boundary payload
    and DDP the reduce of the model's gradients. An explicit ``allreduce_ms`` replaces DDP's.
    """
    fixed = boundary_ms + boundary_ms_per_rank * world

    def on_link(payload_bytes: int) -> float:
        return 0.0 if link_mbit_s is None else link_ms(payload_bytes, world, link_mbit_s, link_latency_ms)

    boundary = fixed + on_link(boundary_bytes)
    if allreduce_ms is not None:
        return boundary, allreduce_ms
    return boundary, fixed + on_link(boundary_bytes if model_bytes is None else model_bytes)


def config_with_link(
    config: ControllerConfig, link_mbit_s: Optional[float], link_latency_ms: float, boundary_bytes: int
) -> ControllerConfig:
    """``config`` told the simulated link and payload, where it does not name its own already."""
    return dataclasses.replace(
        config,
        boundary_bytes=config.boundary_bytes or boundary_bytes,
        link_mbit_s=link_mbit_s if config.link_mbit_s is None else config.link_mbit_s,
        link_latency_ms=config.link_latency_ms or link_latency_ms,
    )


def check_link_arguments(
    link_mbit_s: Optional[float], link_latency_ms: float, boundary_bytes: int, model_bytes: Optional[int]
) -> None:
    """Reject a link the simulator cannot model, naming the argument."""
    if link_mbit_s is not None and not (math.isfinite(link_mbit_s) and link_mbit_s > 0):
        raise ValueError(f"link_mbit_s must be a positive number (Mbit/s) or None, got {link_mbit_s!r}")
    if not (math.isfinite(link_latency_ms) and link_latency_ms >= 0):
        raise ValueError(f"link_latency_ms must be a number >= 0, got {link_latency_ms!r}")
    if link_latency_ms > 0 and link_mbit_s is None:
        raise ValueError("link_latency_ms needs link_mbit_s: without a link there is nothing to add it to")
    for name, count in (("boundary_bytes", boundary_bytes), ("model_bytes", model_bytes)):
        if count is not None and count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
