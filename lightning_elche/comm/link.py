"""The boundary's collectives, counted in bytes on the wire and, when asked, slowed to a slower link.

Every boundary collective goes through one :class:`Wire`, which knows what each rank sends for it
(a ring all-reduce sends ``2 (W-1)/W`` of the tensor, an all-to-all ``(W-1)/W`` of its input, an
all-gather ``W-1`` times its input) and keeps the count per boundary for telemetry and the
controller. With ``delay`` (``lightning_elche.SlowLink.seconds``, a benchmark's simulated link) each
collective is followed by the time those bytes take on that link.

Why a delay in the comm layer rather than shaping the traffic: shaping gloo's TCP connections
needs root (``tc``) or a relay per connection pair, and the delay is what a slow link costs a
blocking collective. The delay starts when the collective returns, so a rank that arrived early
and waited for the others is not spared it, as on a real link, where the transfer starts with the
last arrival. Its limits (docs/slow-links.md): the bytes also crossed the local link first, so it
overstates by that (about a millisecond a megabyte here); concurrent collectives do not share the
simulated bandwidth; a background reduce (``policy="async"``) is held back until its simulated end
when it is waited for, which is how an overlapped transfer on a slow link behaves.

A compressed background reduce computes between its collectives (decode, weight, encode), so it
runs on a thread of its own (:class:`Lane`), over a process group of its own: the main thread's
collectives and its never share a group, and the boundary joins it before issuing any (so on
NCCL no two communicators' kernels wait on each other in different orders on different ranks).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

Delay = Callable[[int], float]  # bytes this rank sends -> seconds on the simulated link


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """torch 2.13 renamed all_gather_into_tensor (deprecated since); torch>=2.4 is supported. Looked up
    at each call, as every other collective here is, so a wrapper of torch.distributed sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


class Wire:
    """The collectives of one fit's boundaries over ``group``, with their bytes counted."""

    def __init__(self, world_size: int, group: Optional[dist.ProcessGroup] = None, delay: Optional[Delay] = None):
        self.world_size = world_size
        self.group = group
        self.delay = delay
        self.sent_bytes = 0  # since the last ``take_sent_bytes``
        self.total_sent_bytes = 0  # since the wire was made (the fit's, for a benchmark's bytes per boundary)

    def take_sent_bytes(self) -> int:
        """The bytes this rank sent since the last call (one boundary's, when called at each)."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A SUM all-reduce."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self._sent(2 * (self.world_size - 1) * _nbytes(tensor) // self.world_size)

    def all_reduce_async(self, tensor: torch.Tensor) -> "Transfer":
        """A SUM all-reduce in the background; its :class:`Transfer` waits for it (and the simulated link)."""
        started = time.perf_counter()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        sent = 2 * (self.world_size - 1) * _nbytes(tensor) // self.world_size
        self.count(sent)
        return Transfer(work, started + (self.delay(sent) if self.delay else 0.0))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal splits: rank r receives the r-th of every rank's ``input`` into ``output``."""
        dist.all_to_all_single(output, input, group=self.group)
        self._sent((self.world_size - 1) * _nbytes(input) // self.world_size)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input``, one after the other in rank order, into ``output``."""
        _all_gather_single(output, input, group=self.group)
        self._sent((self.world_size - 1) * _nbytes(input))

    def count(self, nbytes: int) -> None:
        """Count ``nbytes`` as sent (what another wire sent for this one's boundaries: a :class:`Lane`'s)."""
        self.sent_bytes += nbytes
        self.total_sent_bytes += nbytes

    def _sent(self, nbytes: int) -> None:
        self.count(nbytes)
        if self.delay is not None:
            time.sleep(self.delay(nbytes))


class Transfer:
    """A background all-reduce, done when both it and its simulated link time are."""

    def __init__(self, work: dist.Work, simulated_end: float) -> None:
        self.work = work
        self.simulated_end = simulated_end

    def wait(self) -> None:
        self.work.wait()
        _sleep_until(self.simulated_end)


class Lane:
    """A wire whose collectives run on a thread of their own while the next window trains.

    ``wire`` must be over a process group of its own (every rank creates it at the same point:
    ``groups.new_group_like``); on CUDA the thread works on a stream of its own, ordered after
    what the main stream had queued when it was started, and the main stream waits for it when
    it is joined.
    """

    def __init__(self, wire: Wire, device: torch.device) -> None:
        self.wire = wire
        self.device = device
        # torch's CUDA Stream and Event are untyped
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def run(self, work: Callable[[], None]) -> "Background":
        return Background(work, self.device, self.stream)


class Background:
    """``work`` running on its own thread; :meth:`wait` joins it and raises there what it raised."""

    def __init__(self, work: Callable[[], None], device: torch.device, stream: Optional[torch.cuda.Stream]) -> None:
        self._work = work
        self._device = device
        self._stream = stream
        self._error: Optional[BaseException] = None
        self._ready: Optional[torch.cuda.Event] = None
        self._done: Optional[torch.cuda.Event] = None
        if stream is not None:
            self._ready, self._done = torch.cuda.Event(), torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._main, name="elche-background-reduce", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                if self._stream is None:
                    self._work()
                    return
                assert self._ready is not None and self._done is not None
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._ready)
                    self._work()
                    self._done.record(self._stream)
        except BaseException as error:  # noqa: BLE001 - raised again by wait(), on the thread that waits
            self._error = error

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
