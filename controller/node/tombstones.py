"""Tombstones: a sandbox renamed aside (`<root>/.reap-<id>-<unix-ms>`) before its slow delete.

From the rename on, every open, pin and read of the sandbox finds nothing, which is the truth; the delete then
works on the tombstone. A tombstone's name says who made it (an object's uid, or `p<pid>n<pid namespace>-<hex>`
for a process without one) and when. `retain` stages under a tombstone name too (`...-stage`), so a crash
mid-retain leaves an ordinary leftover. Any entry a scan names (a stray, an unadoptable directory) can be renamed
aside the same way, as a name, and only while it is still the inode it was decided on (`tombstone_entry`).
"""

from __future__ import annotations

import contextlib
import errno as E
import os
import re
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from controller.node import fsdelete
from controller.node.storefs import (
    FILESYSTEMS,
    PRIVATE,
    AtRoot,
    StoreError,
    check_names,
    errno_of,
    held_fd,
    open_dir,
    rename_noreplace,
)
from controller.node.storefs import ident as _ident
from controller.rules.contracts import TOMBSTONE_PREFIX, Reason
from controller.rules.models import is_namespace_name

# Whole-string matches (fullmatch) and ASCII digits: `$` accepts a final newline, `\d` accepts `３`.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_TOMBSTONE = re.compile(re.escape(TOMBSTONE_PREFIX) + r"([A-Za-z0-9][A-Za-z0-9-]{0,63})-([0-9]{1,15})")
# `p<pid>n<pid namespace>-<hex>`; without `n...` (written before the namespace was recorded) the pid is taken as
# this namespace's.
_STANDALONE_ID = re.compile(r"p([0-9]{1,10})(?:n([0-9]{1,20}))?-[0-9a-f]{4,32}(?:-[a-z]{1,8})?")
STAGE_SUFFIX = "stage"  # staging directories are tombstone-named: a crash mid-retain leaves a plain leftover


@dataclass(frozen=True)
class Tombstone:
    """`<root>/.reap-<id>-<unix-ms>`: a sandbox renamed aside, decided for deletion."""

    name: str
    id: str
    made_at: datetime
    path: Path

    @property
    def pid(self) -> int | None:
        """The pid that made it, when the id is a standalone one (`p<pid>n<ns>-<hex>`); None for an object uid."""
        m = _STANDALONE_ID.fullmatch(self.id)
        return int(m.group(1)) if m else None

    def made_here(self, own_namespace: int) -> bool:
        """Whether its pid is one of the PID namespace `own_namespace` (so /proc can say if it is alive). A
        retain in a container (a Job's own PID namespace) writes a pid the agent's /proc knows nothing about,
        or another process's; one whose namespace could not be read (0) is of none."""
        m = _STANDALONE_ID.fullmatch(self.id)
        if m is None or m.group(2) is None:
            return True
        return int(m.group(2)) == own_namespace != 0

    def age(self, now: datetime) -> timedelta:
        return now - self.made_at

    @property
    def staging(self) -> bool:
        """A retain's staging directory (a crash between its two renames leaves one)."""
        return self.id.endswith(f"-{STAGE_SUFFIX}")


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid); 0 when it cannot be read."""
    try:
        return Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        return 0


def standalone_id() -> str:
    """A tombstone id for a process without an object uid: `p<pid>n<pid namespace>-<8 hex>`, so a sweep can tell
    whose it is, and whether that pid means anything in its own /proc."""
    return f"p{os.getpid()}n{pid_namespace()}-{secrets.token_hex(4)}"


def _ms(now: datetime) -> int:
    return int(now.timestamp() * 1000)


def tombstone_name(id: str, now: datetime) -> str:
    """`.reap-<id>-<unix-ms>`: at most 86 bytes whatever the sandbox is called (well inside NAME_MAX)."""
    if not _ID.fullmatch(id):
        raise ValueError(f"tombstone id {id!r} must be 1-64 letters, digits or '-' (an object uid or a short hex)")
    return f"{TOMBSTONE_PREFIX}{id}-{max(_ms(now), 0)}"


def parse_tombstone(name: str, root: Path | None = None) -> Tombstone | None:
    """The tombstone a root entry's name describes, or None when it is not a name this module writes."""
    m = _TOMBSTONE.fullmatch(name)
    if not m:
        return None
    try:
        made = datetime.fromtimestamp(int(m.group(2)) / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return Tombstone(name, m.group(1), made, (root or Path()) / name)


class Tombstones(AtRoot):
    """Renaming aside, putting back and deleting, each fd-relative and never onto an existing name."""

    def lstat_entry(self, rel: str) -> os.stat_result | None:
        """lstat of a root entry named as a scan names it (`ns` or `ns/name`); None when it is gone."""
        parent, base = _split_rel(rel)
        try:
            with (
                held_fd(self._open()) as root_fd,
                held_fd(open_dir(parent, root_fd) if parent else os.dup(root_fd)) as p_fd,
            ):
                return os.lstat(base, dir_fd=p_fd)
        except FileNotFoundError:
            return None

    def tombstone_entry(self, rel: str, ident: tuple[int, int], *, id: str, now: datetime) -> Tombstone:
        """Rename the root entry `rel` (`ns` or `ns/name`, as a scan names it) to a tombstone, as a name.

        A link or a file is renamed itself, never followed. Only the inode `ident` (st_dev, st_ino) is
        renamed: checked before the rename and on the tombstone after it, and one swapped in between is
        put back. Raises StoreError: MANIFEST_CHANGED when the entry is another one, else RENAME_FAILED.
        """
        parent, base = _split_rel(rel)
        tname = tombstone_name(id, now)
        where = self.path / rel
        try:
            with (
                held_fd(self._open()) as root_fd,
                held_fd(open_dir(parent, root_fd) if parent else os.dup(root_fd)) as p_fd,
            ):
                if _ident(os.lstat(base, dir_fd=p_fd)) != ident:
                    raise StoreError(Reason.MANIFEST_CHANGED, f"{where}: replaced since it was decided on", path=where)
                rename_noreplace(p_fd, base, root_fd, tname)
                if _ident(os.lstat(tname, dir_fd=root_fd)) != ident:
                    with contextlib.suppress(OSError):
                        rename_noreplace(root_fd, tname, p_fd, base)
                    raise StoreError(Reason.MANIFEST_CHANGED, f"{where}: swapped during the rename", path=where)
                os.fsync(root_fd)
        except OSError as err:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"{where}: could not rename it to tombstone {tname} ({os.strerror(errno_of(err))}); "
                "it stays under its own name and is retried next pass",
                errno=errno_of(err),
                path=where,
            ) from err
        parsed = parse_tombstone(tname, self.path)
        assert parsed is not None
        return parsed

    def tombstone(self, namespace: str, name: str, *, id: str, now: datetime) -> Tombstone:
        """Rename `<root>/<ns>/<name>` to `<root>/.reap-<id>-<ms>` in one rename (never onto an existing name).

        From the rename on, every open, pin and read of the sandbox finds nothing, which is the truth; the
        slow delete then works on the tombstone. Raises StoreError(RENAME_FAILED) with the errno.
        """
        check_names(namespace, name)
        tname = tombstone_name(id, now)
        try:
            with held_fd(self._open()) as root_fd, held_fd(open_dir(namespace, root_fd)) as ns_fd:
                st = os.lstat(name, dir_fd=ns_fd)
                if not stat.S_ISDIR(st.st_mode):
                    raise StoreError(
                        Reason.RENAME_FAILED,
                        f"sandbox {namespace}/{name}: refused to tombstone it, it is not a directory",
                        errno=E.ENOTDIR,
                        path=self.path / namespace / name,
                    )
                rename_noreplace(ns_fd, name, root_fd, tname)
                os.fsync(root_fd)
        except OSError as err:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"sandbox {namespace}/{name}: could not rename it to tombstone {tname} "
                f"({os.strerror(errno_of(err))}); it stays under its own name and is retried next pass",
                errno=errno_of(err),
                path=self.path / namespace / name,
            ) from err
        parsed = parse_tombstone(tname, self.path)
        assert parsed is not None
        return parsed

    def restore(self, t: Tombstone, namespace: str, name: str) -> bool:
        """Put a tombstone back under `<ns>/<name>`. Only a free name or an EMPTY directory is displaced.

        rename(2) of a directory replaces an empty directory atomically and fails on anything else (a file,
        a link, a non-empty directory), which is exactly the rule: nothing but an empty directory is lost.
        """
        check_names(namespace, name)
        try:
            with held_fd(self._open()) as root_fd:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(namespace, 0o700, dir_fd=root_fd)
                with held_fd(open_dir(namespace, root_fd)) as ns_fd:
                    os.rename(t.name, name, src_dir_fd=root_fd, dst_dir_fd=ns_fd)
                    os.fsync(ns_fd)
        except OSError:
            return False
        return True

    def delete_tombstone(self, t: Tombstone) -> fsdelete.DeleteResult:
        """Delete a tombstone's tree safely (fsdelete: never follows a link, never crosses a mount)."""
        return fsdelete.delete_tree(self.path, t.name)


def _split_rel(rel: str) -> tuple[str | None, str]:
    """(namespace directory or None, entry name) of a root entry as a scan names it; ValueError otherwise.

    Never one of the root's own files, never a tombstone, never `.`/`..`: only what a scan can report.
    """
    parts = rel.split("/")
    bad = (
        len(parts) > 2
        or any(not p or p in (".", "..") or "\0" in p for p in parts)
        or (len(parts) == 2 and not is_namespace_name(parts[0]))
        or (len(parts) == 1 and (rel in PRIVATE | FILESYSTEMS or parse_tombstone(rel) is not None))
    )
    if bad:
        raise ValueError(f"{rel!r} is not a root entry a scan reports")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
