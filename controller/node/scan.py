"""Listing a root: one pass over the root and its namespace directories, reading no manifest and following
no link. What is a sandbox (`Entry`), a tombstone, or neither (`Stray`: reported, or unlinked when it is not a
directory), and the namespace directories left empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from controller.node.storefs import FILESYSTEMS, PRIVATE, AtRoot, held_fd, open_dir
from controller.node.tombstones import Tombstone, parse_tombstone
from controller.rules.contracts import Reason
from controller.rules.models import is_namespace_name, is_object_name


@dataclass(frozen=True)
class Entry:
    """A sandbox directory found by a scan; its manifest is read separately (`Root.read`), once."""

    namespace: str
    name: str
    path: Path


@dataclass(frozen=True)
class Stray:
    """An entry of the root or a namespace directory that is not a sandbox; never followed.

    `rel` is relative to the root (`ns` or `ns/name`); `is_dir` tells whether `remove_stray` may unlink it
    (only non-directories are removed, as the reference does; a directory with a bad name is only reported).
    """

    rel: str
    path: Path
    reason: Reason
    is_dir: bool


@dataclass
class Scan:
    sandboxes: list[Entry] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)
    tombstones: list[Tombstone] = field(default_factory=list)
    empty_namespaces: list[str] = field(default_factory=list)


class Scanner(AtRoot):
    """The root's listing, and the removal of what it found that is no sandbox."""

    def scan(self) -> Scan:
        """One listing of the root and its namespace directories; reads no manifest and follows no link."""
        out = Scan()
        with held_fd(self._open()) as root_fd, os.scandir(root_fd) as entries:
            for entry in entries:
                self._scan_root_entry(root_fd, entry, out)
        out.sandboxes.sort(key=lambda e: (e.namespace, e.name))
        out.tombstones.sort(key=lambda t: (t.made_at, t.name))
        return out

    def _scan_root_entry(self, root_fd: int, entry: os.DirEntry[str], out: Scan) -> None:
        name = entry.name
        if name in PRIVATE or name in FILESYSTEMS:
            return
        if name.startswith("."):
            t = parse_tombstone(name, self.path)
            if t is not None:
                out.tombstones.append(t)
            else:
                out.strays.append(Stray(name, self.path / name, Reason.BAD_NAME, entry.is_dir(follow_symlinks=False)))
            return
        stray = _stray_reason(entry, is_namespace_name(name))
        if stray is not None:
            out.strays.append(Stray(name, self.path / name, stray, entry.is_dir(follow_symlinks=False)))
            return
        try:
            ns_fd = open_dir(name, root_fd)
        except OSError:
            return  # gone (or replaced) since the listing: the next scan sees what it is now
        count = 0
        with held_fd(ns_fd), os.scandir(ns_fd) as subs:
            for sub in subs:
                count += 1
                rel = f"{name}/{sub.name}"
                reason = _stray_reason(sub, is_object_name(sub.name))
                if reason is not None:
                    is_dir = sub.is_dir(follow_symlinks=False)
                    out.strays.append(Stray(rel, self.path / name / sub.name, reason, is_dir))
                else:
                    out.sandboxes.append(Entry(name, sub.name, self.path / name / sub.name))
        if count == 0:
            out.empty_namespaces.append(name)

    def tombstones(self) -> list[Tombstone]:
        return self.scan().tombstones

    def remove_stray(self, stray: Stray) -> bool:
        """Unlink a non-directory stray (a symlink or a file) without following it; directories are kept."""
        if stray.is_dir:
            return False
        parent, _, base = stray.rel.rpartition("/")
        try:
            with held_fd(self._open()) as root_fd:
                if not parent:
                    os.unlink(base, dir_fd=root_fd)
                else:
                    with held_fd(open_dir(parent, root_fd)) as p_fd:
                        os.unlink(base, dir_fd=p_fd)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False
        return True

    def remove_empty_namespace(self, namespace: str) -> bool:
        """rmdir a namespace directory that holds nothing (rmdir never removes anything else)."""
        if not is_namespace_name(namespace):
            return False
        try:
            with held_fd(self._open()) as root_fd:
                os.rmdir(namespace, dir_fd=root_fd)
        except OSError:
            return False
        return True


def _stray_reason(entry: os.DirEntry[str], good_name: bool) -> Reason | None:
    if entry.is_symlink():
        return Reason.SYMLINK
    if not entry.is_dir(follow_symlinks=False):
        return Reason.NOT_A_DIRECTORY
    if not good_name:
        return Reason.BAD_NAME
    return None
