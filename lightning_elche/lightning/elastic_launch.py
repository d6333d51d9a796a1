"""What ``python -m lightning_elche.launch`` tells the process it starts, and the cluster environment
Lightning reads an elastic cohort's rank and world size from.

Lightning reads ``trainer.global_rank`` and ``trainer.world_size`` from the strategy's cluster
environment; torchrun's (``TorchElasticEnvironment``) reads them from the environment variables the
launcher set once and ignores every attempt to change them, so :class:`ElasticEnvironment` holds
them for the cohort to set after each membership change (``lightning/elastic.py``).
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from typing_extensions import override

NOT_LAUNCHED_ELASTIC = (
    "ElCheStrategy(elastic=True) needs a rendezvous store that outlives every rank, which Lightning's "
    "launcher (rank 0 hosts it and ends every rank when one fails) and torchrun (it restarts every rank "
    "when one fails) do not give. Launch the script with `python -m lightning_elche.launch --nproc N "
    "script.py` (docs/elastic.md), or leave elastic=False for a job that stops, quickly and clearly, when a "
    "rank is lost."
)


def launched_elastic() -> bool:
    """Whether ``python -m lightning_elche.launch`` started this process."""
    return os.environ.get("ELCHE_ELASTIC") == "1" and "ELCHE_MEMBER_ID" in os.environ


def member_id() -> int:
    return int(os.environ["ELCHE_MEMBER_ID"])


def joining() -> bool:
    """Whether this process joins a running fit (``--join``, or a replacement) instead of starting it."""
    return os.environ.get("ELCHE_JOIN") == "1"


def spare() -> bool:
    """Whether this joiner is a spare (``--spares``): it joins only in the place of a member that was lost."""
    return os.environ.get("ELCHE_SPARE") == "1"


class ElasticEnvironment(TorchElasticEnvironment):
    """torchrun's environment, with a rank and world size the cohort sets after each membership change."""

    def __init__(self) -> None:
        super().__init__()
        self._rank = int(os.environ.get("RANK", 0))
        self._world_size = int(os.environ.get("WORLD_SIZE", 1))
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))  # unset without the launcher, which the strategy refuses

    @staticmethod
    @override
    def detect() -> bool:
        return launched_elastic()

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    @override
    def local_rank(self) -> int:
        return self._local_rank

    def set_local_rank(self, slot: int) -> None:
        """A spare moves to the device of the member whose place it takes."""
        self._local_rank = slot

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """``devices`` names this machine's devices; the world size is the cohort's, and it changes."""
