"""The elastic cohort's rendezvous store, hosted outside the training processes.

Under Lightning's launcher rank 0 hosts the TCPStore, so rank 0's death takes the store (and with
it every survivor's way to agree on who is left) down. An elastic fit needs a store that outlives
any rank: ``python -m lightning_elche.launch`` hosts one and hands its address to the ranks the way
torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0 included, connects
as a client).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from lightning_elche.cohort.control import Generation
from lightning_elche.comm.store import BoundedStore, KeyValueStore

STORE_TIMEOUT = timedelta(minutes=5)
LAUNCHER_STORE_ANSWER_S = 30.0  # a store that is alive answers a launcher's few reads in far less, even under load


def host_store(host: str, port: int) -> tuple[dist.TCPStore, int]:
    """A TCPStore server on ``host:port`` (port 0: a free one) that waits for no worker; its port."""
    if port == 0:
        port = free_port(host)
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT, use_libuv=True)
    return store, port


def connect_store(host: str, port: int, timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A client connection to the store at ``host:port``."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def launcher_store(host: str, port: int, answer_within_s: float = LAUNCHER_STORE_ANSWER_S) -> BoundedStore:
    """A launcher's connection to the store at ``host:port``: its reads give up after ``answer_within_s``
    (``--store-timeout``; a launcher cut off from the store by a partition would otherwise block in a
    read until TCP gives up, a quarter of an hour, and never end its machine's ranks)."""
    return BoundedStore(connect_store(host, port), answer_within_s, f"the rendezvous store at {host}:{port}")


def agent_store(timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A connection to the store named by the launcher's environment (MASTER_ADDR, MASTER_PORT)."""
    return connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


MEMBER_IDS = "elche/elastic/member_ids"
MEMBER_IDS_RESERVED = "elche/elastic/member_ids_reserved"


def reserve_member_ids(store: KeyValueStore, initial_world_size: int) -> None:
    """The store that hosts a fit starts member ids after the launch's ranks (joiners take the next ones)."""
    store.add(MEMBER_IDS, initial_world_size)
    store.set(MEMBER_IDS_RESERVED, "1")


def ranks_trained(store: KeyValueStore) -> int:
    """How many ranks of the fit have trained a batch so far (``Membership.note_training`` counts them):
    a launcher holds its spares back until the ranks on their way in are among them, since a spare's
    start-up would take the CPU those ranks set up with."""
    return int(store.add("elche/elastic/training", 0))


def next_member_id(store: KeyValueStore) -> int:
    """A member id nobody else gets, for a rank that joins (or replaces one that died). It waits for the
    hosting launcher's reservation: a joiner's launcher started with the fit can reach the store first,
    and would otherwise take a launch rank's id (it did, under load: rank 0 then sent the joiner's
    checkpoint to itself)."""
    store.wait([MEMBER_IDS_RESERVED])
    return int(store.add(MEMBER_IDS, 1)) - 1


def record_exit(store: KeyValueStore, member: int, code: int, launcher: str, slot: int) -> None:
    """The launcher saw ``member``'s process end with ``code``: survivors need not watch its heartbeat,
    and its local rank is free for a spare of this launcher (comm.membership reads both under its prefix)."""
    store.set(f"elche/elastic/exited/{member}", str(code))
    store.add("elche/elastic/exits", 1)  # what survivors poll: one read, however many members
    freed = int(store.add(f"elche/elastic/launcher/{launcher}/freed", 1))
    store.set(f"elche/elastic/launcher/{launcher}/freed/{freed - 1}", str(slot))


LAUNCHERS_ATTACHED = "elche/elastic/launchers_attached"


def attach_launcher(store: KeyValueStore) -> None:
    """A launcher uses the store until it ends (:func:`detach_launcher`): the hosting launcher keeps the store
    up until every launcher has ended (:func:`launchers_attached`)."""
    store.add(LAUNCHERS_ATTACHED, 1)


def detach_launcher(store: KeyValueStore) -> None:
    store.add(LAUNCHERS_ATTACHED, -1)


def launchers_attached(store: KeyValueStore) -> int:
    """How many launchers (the hosting one's own included, until it detaches) still use the store."""
    return int(store.add(LAUNCHERS_ATTACHED, 0))


def cohort_gone(store: KeyValueStore) -> bool:
    """Whether every member of the latest agreed generation exited without finishing the fit (every
    launcher records its members' exits): nobody is left to train on or to admit a joiner."""
    number = 0
    if not store.check(["elche/elastic/generation/0"]):
        return False  # the members have not met yet
    while store.check([f"elche/elastic/generation/{number + 1}"]):
        number += 1
    generation = Generation.decode(store.get(f"elche/elastic/generation/{number}").decode())
    exits = [f"elche/elastic/exited/{member}" for member in generation.members]
    return all(store.check([key]) and store.get(key).decode() != "0" for key in exits)


def end_waiting(store: KeyValueStore) -> None:
    """The fit is over: spares and joiners stop waiting for a place (``Membership.finish``'s mark)."""
    store.set("elche/elastic/finished", "1")


def was_admitted(store: KeyValueStore, member: int) -> bool:
    """Whether a cohort admitted ``member`` (a joiner or spare) at some boundary (``Membership.admit``)."""
    return bool(store.check([f"elche/elastic/admitted/{member}"]))
