"""The rendezvous store behind the default process group: liveness marks and dynamic dispatch's claims use it.

Under Lightning's launcher rank 0 hosts it (a TCPStore); under torchrun, the agent. Using it adds
no service and no port.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist


def default_store() -> Optional[dist.Store]:
    """The default process group's store, or None without a process group (nothing to ask)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, KeyError, AttributeError):
        return None


def private_connection(store: dist.Store) -> dist.Store:
    """A connection of its own to ``store`` where the store can give one: a read stuck on a hung server
    then blocks only it, never the connection torch uses for the process group (TCPStore serialises
    each client's operations)."""
    clone: Optional[Callable[[], dist.Store]] = getattr(store, "clone", None)  # torch's type stubs lack it
    if clone is None:  # a torch or store without clone(): share it
        return store
    try:
        return clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store
