"""The outer optimizer: DiLoCo's step on the pseudo-gradient, applied to the boundary's consensus.

Plain averaging moves the replicas to the consensus. An outer optimizer instead treats
``global_before - consensus`` (how far the cohort's local training moved the model in one window)
as a gradient and steps the global model with Nesterov momentum (Douillard et al., 2023, DiLoCo):
with a few windows of momentum the cohort moves further per window than the average alone. Every
rank runs the same step on the same consensus, so the state is replicated and no collective is added.

With ``min_speed_ratio`` above 1 (the strategy's default) the step is taken only at boundaries
where the members' speeds differ that much: a work-weighted average then pulls the fast members'
progress back towards the slow members' shorter trajectories, and the outer step's extrapolation
makes up for it; among equal speeds the plain average loses nothing and the step would only enlarge
the user's learning rate (benchmarks/time_to_accuracy.py measured both; docs/choosing.md). Its two
copies are made at the first boundary that takes the step, so a cohort of equal speeds holds none.

The averager that steps it binds it (``averaging.py``) and carries its momentum in its own
``state_dict`` (rank 0's, the state being replicated); a boundary that averages without an outer
step (``average_now``, after a membership change) restarts it from that consensus.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

OuterCarry = tuple[torch.Tensor, torch.Tensor, frozenset[tuple[int, int]]]
"""What :meth:`OuterNesterov.carry` returns: the global model, the momentum, the spans begun."""


class OuterNesterov:
    """Nesterov momentum on the pseudo-gradient; ``lr=1, momentum=0`` is plain averaging.

    Args:
        lr: outer learning rate (DiLoCo uses 0.7).
        momentum: outer momentum in [0, 1) (DiLoCo uses 0.9).
        nesterov: Nesterov's look-ahead (True) or heavy-ball momentum.
        min_speed_ratio: take the step only at boundaries where the fastest member ran at least this
            many times the slowest member's steps in the last window (1, the default here: at every
            boundary; the strategy's default outer step uses :data:`SPEED_RATIO_DEFAULT`); at the others
            the consensus is the plain average and the global model follows it.

    Holds two extra copies of the parameters (the last global model and the momentum), on the
    device the boundary reduces on, from the first boundary that takes the step.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, min_speed_ratio: float = 1.0) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0.0 < lr <= 10.0:
            raise ValueError(f"OuterNesterov: `lr` must be a number in (0, 10], got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"OuterNesterov: `momentum` must be a number in [0, 1), got {momentum!r}")
        if isinstance(min_speed_ratio, bool) or not isinstance(min_speed_ratio, (int, float)) or not 1.0 <= min_speed_ratio < math.inf:
            raise ValueError(
                f"OuterNesterov: `min_speed_ratio` must be a number >= 1 (1: an outer step at every boundary), got {min_speed_ratio!r}"
            )
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.min_speed_ratio = float(min_speed_ratio)
        self._region: Optional[torch.Tensor] = None
        self._global: Optional[torch.Tensor] = None
        self._velocity: Optional[torch.Tensor] = None
        self._started: set[tuple[int, int]] = set()  # the spans whose global model is set
        self._speed_ratio = 1.0

    @classmethod
    def following_speed(cls) -> OuterNesterov:
        """The strategy's default: DiLoCo's step where the members' speeds differ by
        :data:`SPEED_RATIO_DEFAULT` or more, plain averaging where they do not."""
        return cls(min_speed_ratio=SPEED_RATIO_DEFAULT)

    def __repr__(self) -> str:
        gate = "" if self.min_speed_ratio == 1.0 else f", min_speed_ratio={self.min_speed_ratio}"
        return f"OuterNesterov(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov}{gate})"

    def bind(self, parameters: torch.Tensor) -> None:
        """Start from ``parameters`` (the flat consensus every rank holds, kept by reference) with no
        momentum; the copies are made now if every boundary steps, else at the first that does."""
        self._region = parameters
        self._global = self._velocity = None
        self._started = set()
        self._speed_ratio = 1.0
        if self.min_speed_ratio == 1.0:
            self._allocate(parameters.detach().clone(), torch.zeros_like(parameters), {self._span(slice(None))})

    def observe(self, window_steps: Sequence[float]) -> None:
        """The steps each member ran in the boundary's window (every rank sees the same list)."""
        moved = [s for s in window_steps if s > 0]
        self._speed_ratio = max(moved) / min(moved) if moved else 1.0

    @property
    def engaged(self) -> bool:
        """Whether the next step is an outer step (the last window's speed ratio reached ``min_speed_ratio``)."""
        return self._speed_ratio >= self.min_speed_ratio

    def restart_from(self, parameters: torch.Tensor) -> None:
        """Take ``parameters`` (a consensus every rank holds) as the global model, keeping the momentum:
        after an average taken without an outer step, from parameters the global model never saw."""
        if self._region is None:
            raise RuntimeError("OuterNesterov.restart_from before bind()")
        if self._global is not None:
            self._global.copy_(parameters)

    def step(self, consensus: torch.Tensor, part: slice = slice(None)) -> None:
        """Replace ``consensus`` (flat, in place) by the global model after one outer step; with
        ``part``, ``consensus`` is that slice of the parameters (a streamed fragment) and only it steps.
        Where not :attr:`engaged`, or at the first engaged boundary of ``part`` (no global model before
        it), the consensus stays the plain average and becomes the global model."""
        if self._region is None:
            raise RuntimeError("OuterNesterov.step before bind(): the strategy binds it at the start of fit")
        span = self._span(part)
        if self._global is None or self._velocity is None:
            if not self.engaged:
                return
            self._allocate(torch.empty_like(self._region), torch.zeros_like(self._region), set())
            assert self._global is not None and self._velocity is not None
        global_model, velocity = self._global[part], self._velocity[part]
        if not self.engaged or not self._begun(span):
            global_model.copy_(consensus)
            self._started.add(span)
            return
        update = global_model.sub(consensus)  # the pseudo-gradient: the one temporary of parameter size
        velocity.mul_(self.momentum).add_(update)
        if self.nesterov:
            update.add_(velocity, alpha=self.momentum)
        else:
            update.copy_(velocity)
        global_model.sub_(update, alpha=self.lr)
        consensus.copy_(global_model)

    def carry(self) -> Optional[OuterCarry]:
        """The global model, the momentum and the spans begun, as they are (None before the copies
        exist), for :meth:`restore` after a new averager of an elastic cohort's next generation bound
        this optimizer again, or after a boundary that is redone."""
        if self._global is None or self._velocity is None:
            return None
        return self._global.clone(), self._velocity.clone(), frozenset(self._started)

    def restore(self, carried: Optional[OuterCarry]) -> None:
        """Go on from :meth:`carry`'s state (the same on every member: replicated); None: no copies yet."""
        if self._region is None:
            return
        if carried is None:
            if self.min_speed_ratio > 1.0:
                self._global = self._velocity = None
                self._started = set()
            return
        self._allocate(carried[0].to(self._region).clone(), carried[1].to(self._region).clone(), set(carried[2]))

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "min_speed_ratio": self.min_speed_ratio,
            "velocity": None if self._velocity is None else self._velocity.detach().cpu().clone(),
            "started": sorted(self._started),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the momentum and the spans begun; call after :meth:`bind` (the global model is the
        restored consensus)."""
        if self._region is None:
            raise RuntimeError("OuterNesterov.load_state_dict before bind()")
        velocity = state.get("velocity")
        if velocity is None:
            return
        if velocity.numel() != self._region.numel():
            raise ValueError(
                f"the checkpoint's outer-optimizer momentum has {velocity.numel()} values, the model "
                f"{self._region.numel()}: was it written for another model?"
            )
        saved = velocity.to(self._region.device, self._region.dtype)
        started = {(int(a), int(b)) for a, b in state.get("started", [self._span(slice(None))])}
        self._allocate(self._region.detach().clone(), saved.clone(), started)

    def _allocate(self, global_model: torch.Tensor, velocity: torch.Tensor, started: set[tuple[int, int]]) -> None:
        self._global, self._velocity, self._started = global_model, velocity, started

    def _begun(self, span: tuple[int, int]) -> bool:
        """Whether ``span``'s global model is set: inside a span begun (bind's whole region, a fragment)."""
        return any(start <= span[0] and span[1] <= stop for start, stop in self._started)

    def _span(self, part: slice) -> tuple[int, int]:
        assert self._region is not None
        start, stop, _ = part.indices(self._region.numel())
        return start, stop


SPEED_RATIO_DEFAULT = 1.5
"""The speed ratio from which the strategy's default outer step applies (``OuterNesterov.following_speed``)."""
