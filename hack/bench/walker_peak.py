"""The compiled walker's own peak memory and threads, for the delete benchmarks (delete.py, deep_delete.py): its
`VmHWM` and `Threads`, read from /proc while it runs. `ru_maxrss` of the children cannot tell them: a child
started by vfork counts the parent's pages it shared until its exec."""

from __future__ import annotations

import os
import threading
from types import TracebackType


def children_status() -> tuple[int, int]:
    """(VmHWM KiB, Threads) of the largest child of this process's threads now; (0, 0) with none."""
    most = (0, 0)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = f.read().split()
            for pid in pids:
                with open(f"/proc/{pid}/status") as f:
                    got = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM:", "Threads:")))
                hwm, threads = int(got["VmHWM"].split()[0]), int(got["Threads"])
                most = (max(most[0], hwm), max(most[1], threads))
        except (OSError, ValueError, KeyError):
            continue  # a child that ended meanwhile, or a thread gone
    return most


class Sampler:
    """The highest `children_status` seen, in `peak`: `sample()` takes one reading (delete.py's event-loop ticker
    calls it), and `with Sampler() as s: ...` takes one every `every` seconds in a thread meanwhile."""

    def __init__(self, every: float = 0.01) -> None:
        self.every, self.peak = every, (0, 0)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self) -> None:
        now = children_status()
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.done.set()
        self.thread.join()
