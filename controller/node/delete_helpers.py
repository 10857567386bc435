"""The process's deletion helper threads: how many (`helpers_wanted`, pure), which shared level each takes next,
started and retired as the disk and the CPU allow. What a helper does on a level is the delete's
(`fsdelete._serve`); the levels are `walker.Frame`s a delete shares.

Caps: `MAX_THREADS` helpers in the process, all deletes together; a delete's own limit (`workers - 1`) is
kept by `next`; an idle helper ends after `IDLE` seconds (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.node.walker import Frame

if TYPE_CHECKING:
    from controller.node.fsdelete import _Delete

MAX_THREADS = 32  # deletion helper threads in the process at most, all deletes together (docs/benchmarks.md)
WINDOW = 0.02  # seconds between two looks at whether more helpers would pay
IDLE = 10.0  # seconds an idle helper waits for work before it ends


def helpers_wanted(threads: int, busy: float, cores: int, waiting: bool, idle: int) -> int:
    """How many helpers to start (> 0) or end (-1) after a window in which the process kept `busy` of its
    `cores` busy, `waiting` levels had entries no helper took and `idle` helpers had nothing to do.

    A disk that makes unlinks wait leaves the CPU idle while levels wait: double, up to MAX_THREADS. A
    process that keeps every core busy gains nothing from one more thread: one ends. Between, keep.
    """
    if busy >= cores - 0.25 and threads > 1:
        return -1
    if busy < cores - 0.5 and waiting and not idle and threads < MAX_THREADS:
        return min(max(threads, 1), MAX_THREADS - threads)
    return 0


class Helpers:
    """The process's deletion helpers: threads that take entries from the levels deletes in progress share,
    the oldest level first, each delete's own limit kept.

    Their number adapts to the disk: while levels wait for a helper and the process leaves CPU idle (its
    threads wait on the disk, not on the CPU or the GIL), every `WINDOW` it doubles, up to `MAX_THREADS`;
    while the process keeps every core busy one retires each window; an idle helper leaves after `IDLE`.
    """

    def __init__(self, serve: Callable[[Frame], None]) -> None:
        self.serve = serve  # one turn on a shared level: take a batch of its entries and remove them
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.levels: dict[Frame, None] = {}  # shared levels with a reader open, oldest first
        self.threads = self.idle = self.retire = 0
        self.serial = itertools.count()
        self.cores = len(os.sched_getaffinity(0))
        self.since, self.cpu = time.monotonic(), time.process_time()
        self.look_at = 0.0

    def share(self, frame: Frame) -> None:
        """Let helpers take from `frame`'s reader (under `frame.lock`)."""
        frame.shared = True
        with self.lock:
            self.levels[frame] = None
            if self.idle:
                self.wake.notify()
            new = [] if self.threads else self.spawn(1)
        for thread in new:
            thread.start()

    def unshare(self, frame: Frame) -> None:
        """No more (under `frame.lock`): its reader is read out or closed."""
        if frame.shared:
            frame.shared = False
            with self.lock:
                del self.levels[frame]

    def pace(self) -> None:
        """Every `WINDOW`: one more doubling while levels wait for a helper and the CPU is not what limits."""
        now = time.monotonic()
        if now < self.look_at:
            return
        new: list[threading.Thread] = []
        with self.lock:
            if now < self.look_at:
                return
            cpu = time.process_time()
            busy = (cpu - self.cpu) / max(now - self.since, 1e-6)  # cores this process kept busy
            self.look_at, self.since, self.cpu = now + WINDOW, now, cpu
            change = helpers_wanted(self.threads - self.retire, busy, self.cores, bool(self.levels), self.idle)
            if change < 0:
                self.retire += 1  # the next helper between two batches ends
            elif change > 0:
                new = self.spawn(change)
        for thread in new:
            thread.start()

    def spawn(self, count: int) -> list[threading.Thread]:
        """`count` more helpers, counted (under `lock`) and started by the caller once it lets go of it."""
        self.threads += count
        return [
            threading.Thread(target=self.run, name=f"fsdelete_{next(self.serial)}", daemon=True) for _ in range(count)
        ]

    def next(self) -> Frame | None:
        """The oldest shared level whose delete may have one more helper, counted (under `lock`)."""
        for frame in self.levels:
            delete = frame.delete
            assert delete is not None
            if delete.helping < delete.helpers:
                delete.helping += 1
                return frame
        return None

    def pick(self, delete: _Delete) -> Frame | None:
        """The oldest level `delete` shares, for one of its own threads waiting on another level."""
        with self.lock:
            return next((frame for frame in self.levels if frame.delete is delete), None)

    def run(self) -> None:
        while True:
            with self.lock:
                frame = None if self.retire else self.next()
                while frame is None:
                    if self.retire:
                        self.retire -= 1
                        self.threads -= 1
                        return
                    self.idle += 1
                    woken = self.wake.wait(IDLE)
                    self.idle -= 1
                    frame = self.next()
                    if frame is None and not woken:
                        self.threads -= 1
                        return
            assert frame.delete is not None
            try:
                self.serve(frame)  # never raises: what went wrong is the delete's failure
            finally:
                with self.lock:
                    frame.delete.helping -= 1
                    if self.idle and self.levels:
                        self.wake.notify()
