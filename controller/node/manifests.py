"""A sandbox's manifest (`manifest.json`): read without following a link anywhere, what a read can say
(`Present`, `Absent`, `Unparsed`, `Unreadable`, `Transient`, `Mismatch`), and a standalone pin written into it.

A manifest that names another sandbox than the path it sits under is a `Mismatch`, never `Present`.
`same_read` is the byte-for-byte "nothing changed" test the sweep uses before acting.
"""

from __future__ import annotations

import errno as E
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import ValidationError

from controller.node.scan import Entry
from controller.node.storefs import (
    TRANSIENT_ERRNOS,
    AtRoot,
    StoreError,
    check_names,
    errno_of,
    held_fd,
    open_dir,
    write_atomic,
)
from controller.node.tombstones import Tombstone
from controller.rules.contracts import MANIFEST_NAME, Reason
from controller.rules.durations import format_instant
from controller.rules.models import Manifest

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few hundred bytes; anything this large is not ours


@dataclass(frozen=True)
class Present:
    manifest: Manifest
    text: str
    reason: Reason = field(default=Reason.RETAINED, compare=False)


@dataclass(frozen=True)
class Absent:
    """No manifest: no file, or the sandbox path is not a directory (a symlink is never followed)."""

    reason: Reason = Reason.MANIFEST_ABSENT


@dataclass(frozen=True)
class Unparsed:
    text: str
    why: str = field(default="", compare=False)
    reason: Reason = field(default=Reason.MANIFEST_UNPARSED, compare=False)


@dataclass(frozen=True)
class Unreadable:
    errno: int
    reason: Reason = field(default=Reason.MANIFEST_UNREADABLE, compare=False)


@dataclass(frozen=True)
class Transient:
    errno: int
    reason: Reason = field(default=Reason.MANIFEST_UNREAD, compare=False)


@dataclass(frozen=True)
class Mismatch:
    """A manifest that names another namespace/name than the path it sits under: refused, never acted on."""

    manifest: Manifest
    text: str
    reason: Reason = field(default=Reason.MANIFEST_MISMATCH, compare=False)


Read = Present | Absent | Unparsed | Unreadable | Transient | Mismatch


def same_read(a: Read, b: Read) -> bool:
    """Whether two reads of one sandbox say the same thing: same kind and, for a file, the same bytes.

    The sweep acts only when a fresh read right before the rename (and one through the tombstone right after
    it) is the same as the read it decided on, so a pin or a replacement in between holds the sandbox.
    Two failures with the same errno are the same; a transient read is never the same as anything.
    """
    if isinstance(a, Transient) or isinstance(b, Transient):
        return False
    if isinstance(a, Absent) or isinstance(b, Absent):
        return isinstance(a, Absent) and isinstance(b, Absent)
    if isinstance(a, Unreadable) or isinstance(b, Unreadable):
        return isinstance(a, Unreadable) and isinstance(b, Unreadable) and a.errno == b.errno
    return type(a) is type(b) and a.text == b.text


def _read_manifest_at(parent_fd: int, name: str) -> Read:
    """Read `<parent>/<name>/manifest.json` without following a link anywhere; the namespace is not checked."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError as err:
        return _failed_read(err)
    if stat.S_ISLNK(st.st_mode):
        return Absent(Reason.SYMLINK)
    if not stat.S_ISDIR(st.st_mode):
        return Absent(Reason.NOT_A_DIRECTORY)
    try:
        with held_fd(open_dir(name, parent_fd)) as dir_fd:
            return _read_manifest_in(dir_fd)
    except OSError as err:
        return _failed_read(err)


def _failed_read(err: OSError) -> Read:
    """What a failed step of reading a manifest means: held (transient), absent, or unreadable."""
    code = errno_of(err)
    if code in TRANSIENT_ERRNOS:
        return Transient(code)
    return Absent() if code in (E.ENOENT, E.ENOTDIR) else Unreadable(code)


def _claimed(read: Read, namespace: str, name: str) -> Read:
    """A manifest that names another sandbox than the path it sits under is a Mismatch, never Present."""
    if isinstance(read, Present) and (read.manifest.namespace, read.manifest.name) != (namespace, name):
        return Mismatch(read.manifest, read.text)
    return read


def _read_manifest_in(dir_fd: int) -> Read:
    """Read `manifest.json` of the open sandbox directory `dir_fd` (never through a link, never a FIFO)."""
    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        with held_fd(fd):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return Unreadable(E.EINVAL)
            chunks: list[bytes] = []
            size = 0
            while size <= MAX_MANIFEST_BYTES:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except OSError as err:
        return _failed_read(err)
    raw = b"".join(chunks)
    text = raw.decode("utf-8", errors="surrogateescape")
    if size > MAX_MANIFEST_BYTES:
        return Unparsed(text[:200], f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return Present(Manifest.model_validate(json.loads(raw)), text)
    except (ValueError, ValidationError) as err:
        return Unparsed(text, str(err).splitlines()[0])


class Manifests(AtRoot):
    """Reading sandboxes' manifests (one, a scan's many, a tombstone's) and pinning one."""

    def read(self, namespace: str, name: str) -> Read:
        """Read one sandbox's manifest (lstat first, never following a link); a foreign manifest is Mismatch."""
        check_names(namespace, name)
        try:
            with held_fd(self._open()) as root_fd, held_fd(open_dir(namespace, root_fd)) as ns_fd:
                result = _read_manifest_at(ns_fd, name)
        except OSError as err:
            code = errno_of(err)
            if code in TRANSIENT_ERRNOS:
                return Transient(code)
            return Absent(Reason.SYMLINK if code == E.ELOOP else Reason.MANIFEST_ABSENT)
        return _claimed(result, namespace, name)

    def read_many(self, entries: Iterable[Entry]) -> dict[tuple[str, str], Read]:
        """`read` for many sandboxes (a scan's), opening the root and each namespace directory once."""
        by_ns: dict[str, list[str]] = {}
        for e in entries:
            by_ns.setdefault(e.namespace, []).append(e.name)
        out: dict[tuple[str, str], Read] = {}
        with held_fd(self._open()) as root_fd:
            for ns, names in by_ns.items():
                try:
                    ns_fd = open_dir(ns, root_fd)
                except OSError as err:
                    code = errno_of(err)
                    failed: Read = Transient(code) if code in TRANSIENT_ERRNOS else Absent()
                    out.update({(ns, n): failed for n in names})
                    continue
                with held_fd(ns_fd):
                    for name in names:
                        out[(ns, name)] = _claimed(_read_manifest_at(ns_fd, name), ns, name)
        return out

    def read_tombstone(self, t: Tombstone) -> Read:
        """Read the manifest inside a tombstone (it keeps the namespace/name of the sandbox it was)."""
        try:
            with held_fd(self._open()) as root_fd:
                return _read_manifest_at(root_fd, t.name)
        except OSError as err:
            code = errno_of(err)
            return Transient(code) if code in TRANSIENT_ERRNOS else Unreadable(code)

    def pin(self, namespace: str, name: str, until: datetime | None, *, now: datetime) -> Manifest:
        """Set (or with `until=None` remove) a standalone pin: `keepUntil` + `pinnedAt`, rewritten atomically.

        The rewrite keeps every key already in the manifest and the file's owner and mode, so a pin taken by
        root leaves a manifest the sweeping uid can still read. Raises StoreError when there is no readable
        manifest of this sandbox to pin.
        """
        check_names(namespace, name)
        where = self.path / namespace / name / MANIFEST_NAME
        try:
            with (
                held_fd(self._open()) as root_fd,
                held_fd(open_dir(namespace, root_fd)) as ns_fd,
                held_fd(open_dir(name, ns_fd)) as dir_fd,
            ):
                # Read and rewrite through ONE directory fd: a retry that replaces the sandbox in between
                # never gets the old run's manifest written over its own.
                read = _claimed(_read_manifest_in(dir_fd), namespace, name)
                if not isinstance(read, Present):
                    raise StoreError(
                        read.reason,
                        f"sandbox {namespace}/{name}: cannot pin it, its manifest is {type(read).__name__.lower()} "
                        f"({read.reason}); check `sandkeep ls` for what is there",
                        errno=getattr(read, "errno", None),
                        path=where,
                    )
                body = json.loads(read.text)
                if until is None:
                    body["keepUntil"], body["pinnedAt"] = None, None
                else:
                    body["keepUntil"], body["pinnedAt"] = format_instant(until), format_instant(now)
                data = (json.dumps(body, indent=2) + "\n").encode()
                st = os.stat(MANIFEST_NAME, dir_fd=dir_fd, follow_symlinks=False)
                write_atomic(dir_fd, MANIFEST_NAME, data, mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
        except OSError as err:
            code = errno_of(err)
            raise StoreError(
                Reason.MANIFEST_ABSENT if code in (E.ENOENT, E.ELOOP, E.ENOTDIR) else Reason.MANIFEST_UNREADABLE,
                f"sandbox {namespace}/{name}: cannot pin it ({os.strerror(code)}); nothing was changed. "
                "Check `sandkeep ls` for what is there",
                errno=code,
                path=where,
            ) from err
        return Manifest.model_validate(body)


def manifest_in(dir_fd: int, namespace: str, name: str) -> Read:
    """The manifest of the open sandbox directory `dir_fd`, Present only when it names namespace/name."""
    return _claimed(_read_manifest_in(dir_fd), namespace, name)
