"""The outer optimizer: DiLoCo's step on the pseudo-gradient, applied to the boundary's consensus.

Plain averaging moves the replicas to the consensus. An outer optimizer instead treats
``global_before - consensus`` (how far the cohort's local training moved the model in one window)
as a gradient and steps the global model with Nesterov momentum (Douillard et al., 2023, DiLoCo):
with a few windows of momentum the cohort moves further per window than the average alone. Every
rank runs the same step on the same consensus, so the state is replicated and no collective is added.

The averager that steps it binds it (``averaging.py``) and carries its momentum in its own
``state_dict`` (rank 0's, the state being replicated); a boundary that averages without an outer
step (``average_now``, after a membership change) restarts it from that consensus.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


class OuterNesterov:
    """Nesterov momentum on the pseudo-gradient; ``lr=1, momentum=0`` is plain averaging.

    Args:
        lr: outer learning rate (DiLoCo uses 0.7).
        momentum: outer momentum in [0, 1) (DiLoCo uses 0.9).
        nesterov: Nesterov's look-ahead (True) or heavy-ball momentum.

    Holds two extra copies of the parameters (the last global model and the momentum), on the
    device the boundary reduces on.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0.0 < lr <= 10.0:
            raise ValueError(f"OuterNesterov: `lr` must be a number in (0, 10], got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"OuterNesterov: `momentum` must be a number in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self._global: Optional[torch.Tensor] = None
        self._velocity: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"OuterNesterov(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov})"

    def bind(self, parameters: torch.Tensor) -> None:
        """Start from ``parameters`` (the flat consensus every rank holds) with no momentum."""
        self._global = parameters.detach().clone()
        self._velocity = torch.zeros_like(self._global)

    def restart_from(self, parameters: torch.Tensor) -> None:
        """Take ``parameters`` (a consensus every rank holds) as the global model, keeping the momentum:
        after an average taken without an outer step, from parameters the global model never saw."""
        if self._global is None:
            raise RuntimeError("OuterNesterov.restart_from before bind()")
        self._global.copy_(parameters)

    def step(self, consensus: torch.Tensor, part: slice = slice(None)) -> None:
        """Replace ``consensus`` (flat, in place) by the global model after one outer step; with
        ``part``, ``consensus`` is that slice of the parameters (a streamed fragment) and only it steps."""
        if self._global is None or self._velocity is None:
            raise RuntimeError("OuterNesterov.step before bind(): the strategy binds it at the start of fit")
        global_model, velocity = self._global[part], self._velocity[part]
        update = global_model.sub(consensus)  # the pseudo-gradient: the one temporary of parameter size
        velocity.mul_(self.momentum).add_(update)
        if self.nesterov:
            update.add_(velocity, alpha=self.momentum)
        else:
            update.copy_(velocity)
        global_model.sub_(update, alpha=self.lr)
        consensus.copy_(global_model)

    def carry(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The global model and the momentum as they are (None before :meth:`bind`), for :meth:`restore`
        after a new averager of an elastic cohort's next generation bound this optimizer again."""
        if self._global is None or self._velocity is None:
            return None
        return self._global.clone(), self._velocity.clone()

    def restore(self, carried: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Go on from :meth:`carry`'s global model and momentum (the same on every member: replicated)."""
        if carried is not None and self._global is not None and self._velocity is not None:
            self._global.copy_(carried[0])
            self._velocity.copy_(carried[1])

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "velocity": None if self._velocity is None else self._velocity.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the momentum; call after :meth:`bind` (the global model is the restored consensus)."""
        if self._velocity is None:
            raise RuntimeError("OuterNesterov.load_state_dict before bind()")
        velocity = state.get("velocity")
        if velocity is None:
            return
        if velocity.numel() != self._velocity.numel():
            raise ValueError(
                f"the checkpoint's outer-optimizer momentum has {velocity.numel()} values, the model "
                f"{self._velocity.numel()}: was it written for another model?"
            )
        self._velocity.copy_(velocity.to(self._velocity.device, self._velocity.dtype))
