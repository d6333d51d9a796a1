"""The rendezvous store behind the default process group: liveness marks and dynamic dispatch's claims use it.

Under Lightning's launcher rank 0 hosts it (a TCPStore); under torchrun, the agent. Using it adds
no service and no port.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Generic, Optional, Protocol, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def first_line(error: BaseException) -> str:
    """torch's errors carry a C++ stack trace after the first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer: its server is gone or stopped, or this machine is cut off from it."""


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


class KeyValueStore(Protocol):
    """The store operations ElChe's membership and launcher use (a ``dist.Store`` has them all)."""

    def add(self, key: str, value: int, /) -> int: ...
    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def check(self, keys: list[str], /) -> bool: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str, /) -> bytes: ...
    def wait(self, keys: list[str], /) -> None: ...


class StoreCall(Generic[T]):
    """One operation handed to the connection's thread. ``done`` is a plain lock, held until the operation
    ran: a waiting caller wakes through one lock rather than an ``Event``'s Condition and its locks, which
    matters on a busy machine, where every claim of dynamic dispatch pays the hand-over twice
    (``benchmarks/step_cost.py``: 166-219 microseconds a claim against 221-401 with the ``Event``).
    ``round_trip_ms`` is the operation's own time on the thread, not the time it queued."""

    def __init__(self, operation: Callable[[], T]) -> None:
        self.operation = operation
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Optional[T] = None
        self.error: Optional[BaseException] = None
        self.round_trip_ms = 0.0

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.result = self.operation()
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which re-raises it
            self.error = error
        self.round_trip_ms = (time.perf_counter() - started) * 1000.0
        self.done.release()


class BoundedStore:
    """A store whose operations give up after ``answer_within_s``, raising :class:`StoreUnreachable`.

    TCPStore's ``add``, ``check``, ``get`` and ``compare_set`` wait for the server's reply without any
    timeout (only ``wait`` and connecting have one): against a stopped server, or across a network
    partition, they block until TCP itself gives up, a quarter of an hour later. Each operation here
    runs on the connection's own daemon thread and the caller waits for it at most ``answer_within_s``;
    a thread left blocked is abandoned (it ends with the process), and every later operation fails at
    once. ``wait`` keeps the store's own timeout."""

    def __init__(self, store: KeyValueStore, answer_within_s: float, what: str = "the rendezvous store") -> None:
        self._store = store
        self._answer_within_s = answer_within_s
        self._what = what
        self._pending: queue.SimpleQueue[StoreCall[object]] = queue.SimpleQueue()
        self._stuck: Optional[str] = None
        threading.Thread(target=self._serve, name="elche-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._pending.get().run()

    def _call(self, operation: Callable[[], T]) -> T:
        return self.answer(self.submit(operation))

    def submit(self, operation: Callable[[], T]) -> StoreCall[T]:
        """Hand ``operation`` to the connection's thread and return at once; :meth:`answer` waits for it."""
        if self._stuck is not None:
            raise StoreUnreachable(self._stuck)
        call: StoreCall[T] = StoreCall(operation)
        self._pending.put(call)  # type: ignore[arg-type]  # StoreCall is read-only for the serving thread
        return call

    def answer(self, call: StoreCall[T]) -> T:
        """``call``'s result, waiting for it at most ``answer_within_s`` from now."""
        if not call.done.acquire(timeout=self._answer_within_s):
            self._stuck = (f"{self._what} did not answer within {self._answer_within_s:g} s (its server is stopped, "
                           "or this machine is cut off from it)")
            raise StoreUnreachable(self._stuck)
        if isinstance(call.error, dist.DistNetworkError):  # the server exited, or a partition reset the connection
            self._stuck = f"{first_line(call.error)} (the connection to {self._what})"
            raise StoreUnreachable(self._stuck) from call.error
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]  # set by run() whenever error is None

    def add_later(self, key: str, value: int, /) -> StoreCall[int]:
        """``add`` handed to the connection's thread: the caller goes on while the store answers."""
        return self.submit(lambda: self._store.add(key, value))

    def add(self, key: str, value: int, /) -> int:
        return self.answer(self.add_later(key, value))

    def set(self, key: str, value: str, /) -> None:
        self._call(lambda: self._store.set(key, value))

    def get(self, key: str, /) -> bytes:
        return self._call(lambda: self._store.get(key))

    def check(self, keys: list[str], /) -> bool:
        return self._call(lambda: self._store.check(keys))

    def compare_set(self, key: str, expected_value: str, desired_value: str, /) -> bytes:
        return self._call(lambda: self._store.compare_set(key, expected_value, desired_value))

    def wait(self, keys: list[str], /) -> None:
        self._store.wait(keys)

    def appears(self, key: str, within_s: float) -> bool:
        """Whether ``key`` is in the store within ``within_s`` (the store tells at once when it is set)."""
        waits = self._store.wait  # dist.Store's, which also takes a timeout

        def wait() -> bool:
            try:
                waits([key], timedelta(seconds=within_s))  # type: ignore[call-arg]  # the KeyValueStore protocol omits it
            except dist.DistStoreError:  # the timeout: not set yet
                return False
            return True

        return self._call(wait)
