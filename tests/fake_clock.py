"""A clock for tests that assert how long product code waited: time passes only when the code sleeps
(or the test says so), so a loaded machine cannot stretch what is measured.

Product modules call ``time.monotonic()``/``time.sleep()`` through their module's ``time`` name; a test
swaps that name for a :class:`FakeClock` (``monkeypatch.setattr(module, "time", FakeClock())``)."""

from __future__ import annotations

import threading


class FakeClock:
    """``monotonic``/``perf_counter``/``thread_time``/``process_time`` read one counter of seconds;
    ``sleep`` advances it and returns at once, recording the sleep."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    perf_counter = thread_time = process_time = time = monotonic

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        with self._lock:
            self.sleeps.append(seconds)

    def advance(self, seconds: float) -> None:
        """Time passes without a sleep (work the code under test did, as far as this clock tells)."""
        assert seconds >= 0, seconds
        with self._lock:
            self.now += seconds
