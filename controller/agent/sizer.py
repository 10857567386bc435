"""Sandbox sizes, measured by a background thread so they never block a pass."""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from controller.node.nofollow import open_no_symlinks
from controller.node.store import Root
from controller.node.treesize import TreeSize
from controller.observe import logs
from controller.rules import contracts as c

Key = tuple[str, str]
log = logging.getLogger("sandkeep.agent")


def measure(root: Root, namespace: str, name: str, budget: float | None = None) -> TreeSize:
    """(allocated bytes, files, complete, reason) under a sandbox: `Root.usage`, fd-relative, never following
    links or entering mounts, linear in the tree, memory bounded (a 2,000-level chain once killed this thread).

    One thread measures every sandbox of the node, so one tree must not hold it: past `budget` seconds the
    walk stops and the bytes it counted are the size, marked incomplete (SizeTooSlow). A partial size is a
    lower bound, still counted by the quota and disk pressure; 0 (never measured) would count nothing.
    """
    try:
        return root.usage(namespace, name, budget)
    except (OSError, ValueError):
        return TreeSize(0, 0)


def workspace_stat(root: Path, namespace: str, name: str) -> os.stat_result | OSError | None:
    """The sandbox's workspace as fstat sees it, no link followed anywhere; None: it is not there."""
    try:
        fd = open_no_symlinks(root / namespace / name / c.WORKSPACE_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:  # ELOOP (a link on the way) is an answer too: it is not the sandbox's
        return None if err.errno == errno.ELOOP else err
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def owner(root: Root, namespace: str, name: str) -> tuple[int, int] | None:
    """(uid, gid) of a sandbox's workspace, read without following links: whom a session runs as."""
    st = workspace_stat(Path(root.path), namespace, name)
    return None if st is None or isinstance(st, OSError) else (st.st_uid, st.st_gid)


class Sizer(threading.Thread):
    """Measures sandbox sizes (and workspace owners) off the loop; tells the loop when one changed."""

    def __init__(self, root: Root, changed: Callable[[Key], None], budget: float | None = None) -> None:
        super().__init__(name="sizes", daemon=True)
        self.root = root
        self.changed = changed
        self.budget = budget  # seconds one sandbox's walk may take (None: no limit)
        self.sizes: dict[Key, TreeSize] = {}
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
            try:
                self.measure_one(key)
            except Exception as err:  # a bug must not end the only thread that measures: said, tried next pass
                logs.say(log, "size_failed", level=logging.ERROR, object="/".join(key), error=repr(err)[:300])

    def measure_one(self, key: Key) -> None:
        size, who = measure(self.root, *key, budget=self.budget), owner(self.root, *key)
        if self.sizes.get(key) != size or (who is not None and self.owners.get(key) != who):
            if who is not None:  # first: a report between the two must never see the size alone
                self.owners[key] = who
            self.sizes[key] = size
            self.changed(key)
