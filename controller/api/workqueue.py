"""A work queue for one asyncio loop, with client-go's verbs: add, add_after, add_rate_limited, forget.

Used by the controller and the agent alike; they hold one, they do not contain one.

- `add(key)` queues a key once however often it is asked for; a key being processed (`get` .. `done`)
  is queued again when it is done, so no key is ever worked on twice at once.
- `add(key, priority=0)` goes before priority 1 (the default): due deadlines before watch-driven
  status rewrites, so a policy change over ten thousand objects never makes a due deletion wait.
- `add_after(key, seconds)` queues it later; the earliest pending request for a key wins. One timer
  callback for the earliest due key (no task per sleep: kopf's shutdown waits 5 s for every task it
  did not start).
- `get()` waits for the next key; `get_ready(limit)` takes more that are ready now, for a batch.
- `add_rate_limited(key)` is `add_after` with per-key exponential backoff (base, 2x base, ... up to
  max); `forget(key)` resets it once the key succeeds; `drop(key)` also cancels its pending
  `add_after` (the object is gone), so the queue's memory follows the live keys.
- `instrument(metrics, name)` exports it as client-go's MetricsProvider does, under controller-runtime's
  names (`workqueue_*{name,controller}`, observe/metrics.py `QueueMetrics`): adds, the time a key waits
  queued and the time it is worked on, retries (every `add_after`, as client-go counts them); the depth and
  the work still under way are read when scraped (`depths`, `running`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Hashable
from typing import Generic, TypeVar

from controller.observe.metrics import QueueInstruments, QueueMetrics

K = TypeVar("K", bound=Hashable)

BASE_DELAY = 0.5  # seconds before the first retry of a failed key
MAX_DELAY = 60.0  # the backoff's ceiling
_NOT_QUEUED = 2  # a priority lower than any real one


class WorkQueue(Generic[K]):
    def __init__(self, base_delay: float = BASE_DELAY, max_delay: float = MAX_DELAY) -> None:
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._ready: asyncio.PriorityQueue[tuple[int, int, K]] = asyncio.PriorityQueue()
        self._queued: dict[K, int] = {}  # key -> the priority it is queued with
        self._added: dict[K, float] = {}  # key -> when it was queued (monotonic), while it is
        self._active: dict[K, float] = {}  # key being processed -> when it was taken (monotonic)
        self._seq = itertools.count()
        self._later: list[tuple[float, int, K]] = []  # heap of (due on the loop clock, seq, key)
        self._due: dict[K, tuple[float, int]] = {}  # key -> (its earliest due time, priority then)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._failures: dict[K, int] = {}
        self._m: QueueInstruments | None = None

    def instrument(self, metrics: QueueMetrics, name: str) -> None:
        """Export this queue's series as `name` (its `name` and `controller` labels)."""
        self._m = metrics.watch(name, self)

    # --- the verbs ---------------------------------------------------------------------------------

    def add(self, key: K, priority: int = 1) -> None:
        """Queue `key` now (once); a key being processed is queued again when it is done."""
        if self._queued.get(key, _NOT_QUEUED) <= priority:
            return
        if key not in self._queued:  # a new add (a queued key's priority raised is not one)
            self._added[key] = time.monotonic()
            if self._m is not None:
                self._m.adds.inc()
        self._queued[key] = priority
        if key not in self._active:
            self._ready.put_nowait((priority, next(self._seq), key))

    def add_after(self, key: K, seconds: float, priority: int = 0) -> None:
        """Queue `key` in `seconds`; an earlier pending request for it wins over a later one."""
        if self._m is not None:
            self._m.retries.inc()
        if seconds <= 0:
            self.add(key, priority)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + seconds
        current = self._due.get(key)
        if current is not None and current[0] <= due:
            return
        self._due[key] = (due, priority)
        heapq.heappush(self._later, (due, next(self._seq), key))
        if self._timer_at is None or due < self._timer_at:
            self._arm(loop, due)

    def add_rate_limited(self, key: K, priority: int = 0) -> float:
        """Queue `key` after its backoff (which doubles with each failure); returns the delay chosen."""
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay: float = min(self.max_delay, self.base_delay * 2.0 ** min(failures - 1, 32))
        self.add_after(key, delay, priority)
        return delay

    def forget(self, key: K) -> None:
        """The key succeeded: its next failure starts the backoff from the base again."""
        self._failures.pop(key, None)

    def drop(self, key: K) -> None:
        """The key is gone: forget it and cancel its pending `add_after` (a queued `add` still runs)."""
        self._failures.pop(key, None)
        self._due.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)

    # --- the worker's side -------------------------------------------------------------------------

    async def get(self) -> K:
        """The next key to process; call `done(key)` when finished with it. Cancel-safe."""
        while True:
            _priority, _seq, key = await self._ready.get()
            if key not in self._queued or key in self._active:
                continue  # a stale entry: queued again with a higher priority, or being processed
            self._take(key)
            return key

    def get_ready(self, limit: int) -> list[K]:
        """Up to `limit` more keys that are ready now, without waiting: a worker that handles a batch at
        once (the agent's one /proc pass for a wave of deletions) takes them together. `done` each one."""
        out: list[K] = []
        while len(out) < limit and not self._ready.empty():
            _priority, _seq, key = self._ready.get_nowait()
            if key not in self._queued or key in self._active:
                continue
            self._take(key)
            out.append(key)
        return out

    def _take(self, key: K) -> None:
        del self._queued[key]
        now = time.monotonic()
        added = self._added.pop(key, now)
        self._active[key] = now
        if self._m is not None:
            self._m.latency.observe(now - added)

    def done(self, key: K) -> None:
        started = self._active.pop(key, None)
        if started is not None and self._m is not None:
            self._m.work.observe(time.monotonic() - started)
        if key in self._queued:
            self._ready.put_nowait((self._queued[key], next(self._seq), key))

    def busy(self) -> bool:
        """Anything queued or being processed (pending `add_after`s do not count)."""
        return bool(self._queued or self._active)

    def waiting(self) -> int:
        """Keys with a pending `add_after`."""
        return len(self._due)

    # --- read when scraped, from the metrics server's thread (each a one-step copy of a dict) ---------------

    def depths(self) -> dict[int, int]:
        """Keys waiting to be taken, by priority (a key queued again while it is processed waits for `done`)."""
        active = set(list(self._active))
        out: dict[int, int] = {}
        for key, priority in list(self._queued.items()):
            if key not in active:
                out[priority] = out.get(priority, 0) + 1
        return out

    def running(self) -> list[float]:
        """Seconds each key being processed has been at it."""
        now = time.monotonic()
        return [now - started for started in list(self._active.values())]

    # --- the timer ---------------------------------------------------------------------------------

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(due, self._fire)
        self._timer_at = due

    def _pending(self, entry: tuple[float, int, K]) -> bool:
        current = self._due.get(entry[2])
        return current is not None and current[0] == entry[0]

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._later and self._later[0][0] <= now:
            entry = heapq.heappop(self._later)
            if self._pending(entry):  # else stale: replaced by an earlier request, or dropped
                _due, priority = self._due.pop(entry[2])
                self.add(entry[2], priority)
        while self._later and not self._pending(self._later[0]):
            heapq.heappop(self._later)  # stale heads go now, so the timer is armed for a real one
        if self._later:
            self._arm(loop, self._later[0][0])
