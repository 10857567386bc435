"""Sandbox sizes, measured by a background thread so they never block a pass."""

from __future__ import annotations

import contextlib
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterable

from controller.store import Root

Key = tuple[str, str]


def measure(root: Root, namespace: str, name: str) -> tuple[int, int]:
    """(allocated bytes, files) under a sandbox, walked fd-relative without following links or mounts."""
    total = files = 0
    try:
        top = root.sandbox_path(namespace, name)
        st = os.lstat(top)
    except (OSError, ValueError):
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return 0, 0
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False):
        keep = []
        for d in dirnames:
            with contextlib.suppress(OSError):
                dst = os.stat(d, dir_fd=dirfd, follow_symlinks=False)
                total += dst.st_blocks * 512
                if dst.st_dev == st.st_dev:
                    keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            with contextlib.suppress(OSError):
                total += os.stat(f, dir_fd=dirfd, follow_symlinks=False).st_blocks * 512
                files += 1
    return total + st.st_blocks * 512, files


class Sizer(threading.Thread):
    """Measures sandbox sizes off the loop; tells the loop when a size changed."""

    def __init__(self, root: Root, changed: Callable[[Key], None]) -> None:
        super().__init__(name="sizes", daemon=True)
        self.root = root
        self.changed = changed
        self.sizes: dict[Key, tuple[int, int]] = {}
        self.todo: queue.Queue[Key | None] = queue.Queue()  # None: stop
        self.pending: set[Key] = set()
        self.lock = threading.Lock()

    def request(self, keys: Iterable[Key]) -> None:
        with self.lock:
            for k in keys:
                if k not in self.pending:
                    self.pending.add(k)
                    self.todo.put(k)

    def stop(self) -> None:
        self.todo.put(None)

    def run(self) -> None:
        while True:
            key = self.todo.get()
            if key is None:
                return
            with self.lock:
                self.pending.discard(key)
            size = measure(self.root, *key)
            if self.sizes.get(key) != size:
                self.sizes[key] = size
                self.changed(key)
