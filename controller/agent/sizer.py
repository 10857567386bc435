"""Sandbox sizes, measured by a background thread so they never block a pass."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from controller.agent.sessions import workspace_stat
from controller.store import Root

Key = tuple[str, str]


def measure(root: Root, namespace: str, name: str) -> tuple[int, int]:
    """(allocated bytes, files) under a sandbox: `Root.usage`, fd-relative, never following links or entering
    mounts, never recursing, with memory bounded per open level (a 2,000-level chain once killed this thread)."""
    try:
        size = root.usage(namespace, name)
    except (OSError, ValueError):
        return 0, 0
    return size.bytes, size.files


def owner(root: Root, namespace: str, name: str) -> tuple[int, int] | None:
    """(uid, gid) of a sandbox's workspace, read without following links: whom a session runs as."""
    st = workspace_stat(Path(root.path), namespace, name)
    return None if st is None or isinstance(st, OSError) else (st.st_uid, st.st_gid)


class Sizer(threading.Thread):
    """Measures sandbox sizes (and workspace owners) off the loop; tells the loop when one changed."""

    def __init__(self, root: Root, changed: Callable[[Key], None]) -> None:
        super().__init__(name="sizes", daemon=True)
        self.root = root
        self.changed = changed
        self.sizes: dict[Key, tuple[int, int]] = {}
        self.owners: dict[Key, tuple[int, int]] = {}
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
            size, who = measure(self.root, *key), owner(self.root, *key)
            if self.sizes.get(key) != size or (who is not None and self.owners.get(key) != who):
                if who is not None:  # first: a report between the two must never see the size alone
                    self.owners[key] = who
                self.sizes[key] = size
                self.changed(key)
