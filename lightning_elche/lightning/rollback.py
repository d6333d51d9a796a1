"""What a member of an elastic cohort keeps to undo a boundary that does not commit.

A boundary changes a rank's parameters and buffers (the consensus replaces them), its averager's
state (error feedback, fragment turns, async's snapshot) and the outer optimizer's global model and
momentum, as the exchange proceeds. When a member is lost during the exchange, some survivors may have
completed it and others not; the boundary then rolls back on every survivor (``Membership.commit``
decides), so that they agree: each restores what it had before the boundary and the survivors redo it
among themselves in the next generation, where this rank's averager state is what it contributes.

Costs one copy of the parameters and buffers per boundary, on the device they live on, plus a
copy of the averager's state (under compression, the error feedback: one float per parameter) and of
the outer optimizer's two vectors when there is one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_elche.comm.interface import Averager
from lightning_elche.comm.outer import OuterCarry, OuterNesterov


@dataclass
class KeptState:
    """A rank's state before a boundary."""

    tensors: list[torch.Tensor]  # its parameters and buffers, copied
    outer: Optional[OuterCarry]  # the outer optimizer's global model, momentum and spans begun
    averager_state: dict[str, Any]  # its averager's state_dict, copied

    @classmethod
    def of(cls, module: nn.Module, averager: Averager, outer: Optional[OuterNesterov]) -> "KeptState":
        with torch.no_grad():
            tensors = [tensor.detach().clone() for tensor in _state_tensors(module)]
        return cls(tensors, None if outer is None else outer.carry(), copy.deepcopy(averager.state_dict()))

    @torch.no_grad()
    def restore(self, module: nn.Module, outer: Optional[OuterNesterov]) -> None:
        """The parameters, buffers and outer state as they were before the boundary."""
        for tensor, kept in zip(_state_tensors(module), self.tensors):
            tensor.copy_(kept)
        if outer is not None:
            outer.restore(self.outer)


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What a boundary writes: the parameters and the buffers (BatchNorm statistics and counters)."""
    return [*module.parameters(), *module.buffers()]
