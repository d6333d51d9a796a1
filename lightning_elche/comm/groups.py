"""Process groups and the once-per-fit collectives: set-up, teardown, the checkpoint's gather and outcome.

The strategy's lifecycle (``lightning/strategy.py``) calls these; none runs per boundary.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _init_dist_connection
from lightning.pytorch.overrides.distributed import _sync_module_states
from torch import nn

# The gloo group of reduce_on="cpu", with the default group it was made from: one per default group.
_boundary_groups: Optional[tuple[Optional[dist.ProcessGroup], dist.ProcessGroup]] = None


def boundary_group(reduce_on: str, timeout: timedelta) -> Optional[dist.ProcessGroup]:
    """The group boundaries and the checkpoint gather reduce over: None (the default group) for
    reduce_on "device" or a gloo default group; for reduce_on "cpu" over NCCL, a gloo group made once
    per default group (every rank must ask at the same point the first time: it is a collective)."""
    global _boundary_groups
    if reduce_on == "device" or dist.get_backend() == "gloo":
        return None
    default = dist.group.WORLD
    if _boundary_groups is None or _boundary_groups[0] is not default:
        _boundary_groups = (default, dist.new_group(backend="gloo", timeout=timeout))
    return _boundary_groups[1]


def new_node_groups(nodes: Sequence[Sequence[int]], timeout: Optional[timedelta] = None) -> list[dist.ProcessGroup]:
    """One group per node; every rank creates every node's group, in the same order (torch requires it).

    ``timeout``: the boundary group's, so that a rank lost in a node's reduce fails the others as
    soon as in any boundary collective (None: torch's default, 30 minutes)."""
    return [dist.new_group(list(ranks), timeout=timeout) for ranks in nodes]


def new_group_like(group: Optional[dist.ProcessGroup], timeout: Optional[timedelta] = None) -> dist.ProcessGroup:
    """Another group of every rank on ``group``'s backend (None: the default group's), for collectives
    on a thread of their own; every rank creates it at the same point (a collective). ``timeout``:
    as for :func:`new_node_groups`."""
    created: dist.ProcessGroup = dist.new_group(backend=dist.get_backend(group), timeout=timeout)
    return created


def restart_attempt() -> Optional[str]:
    """torchrun's restart count when its agent's rendezvous store is shared across restarts, else None."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return attempt


def init_process_group_for_restart(
    environment: ClusterEnvironment,
    backend: str,
    attempt: str,
    timeout: timedelta,
    device_id: Optional[torch.device],
) -> None:
    """The default process group under a torchrun restart, on a key prefix of its own.

    torchrun's agent keeps one rendezvous store across restarts, so the relaunched ranks would
    read the dead ones' gloo/NCCL addresses and fail to connect (pytorch/pytorch#167288).
    """
    agent_store = dist.TCPStore(
        environment.main_address, environment.main_port, environment.world_size(), is_master=False, timeout=timeout
    )
    _init_dist_connection(
        environment,
        backend,
        store=dist.PrefixStore(f"elche/attempt_{attempt}", agent_store),
        timeout=timeout,
        device_id=device_id,
    )


def broadcast_module_states(module: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (what DistributedDataParallel does at wrap time)."""
    _sync_module_states(module)


def gather_to_rank0(obj: Any, rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> Optional[list[Any]]:
    """Every rank's ``obj``, in rank order, on rank 0; None elsewhere."""
    if world_size == 1:
        return [obj]
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered


def split_among_ranks(work: Sequence[Any], do: Callable[[Any], Any]) -> dict[Any, Any]:
    """``do(item)`` for every item of ``work``, each rank doing every world-size-th one, the results
    gathered on every rank (all ranks call it; without a process group this process does it all).
    An exception on one rank is raised on every rank, after the gather, so none is left waiting."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine: dict[Any, Any] = {}
    failed: Optional[Exception] = None
    for item in work[rank::world_size]:
        try:
            mine[item] = do(item)
        except Exception as error:  # noqa: BLE001 - handed to every rank below
            failed = error
            break
    done: dict[Any, Any] = {}
    for part, raised in gather_to_all((mine, failed), world_size, None):
        if raised is not None:
            raise raised
        done.update(part)
    return done


def gather_to_all(obj: Any, world_size: int, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def from_rank0(obj: Any, rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> Any:
    """Rank 0's ``obj`` on every rank (what the others pass is ignored)."""
    if world_size == 1 or not dist.is_initialized():
        return obj
    holder = [obj if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def destroy_process_group_at_exit() -> None:
    """Destroy the process group at interpreter exit, whatever the backend (registered once).

    Lightning does so only for NCCL; a gloo group left to interpreter shutdown can abort the
    process ("terminate called without an active exception") after training has finished.
    """
    atexit.unregister(_destroy_dist_connection)
    atexit.register(_destroy_dist_connection)


def send_from_rank0(obj: Any, ranks: Sequence[int]) -> None:
    """Rank 0 sends ``obj`` to each of ``ranks`` (point to point: the others take no part)."""
    for rank in ranks:
        dist.send_object_list([obj], dst=rank)


def receive_from_rank0() -> Any:
    """What rank 0 sent this rank with :func:`send_from_rank0`."""
    holder: list[Any] = [None]
    dist.recv_object_list(holder, src=0)
    return holder[0]
