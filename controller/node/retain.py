"""Retaining a finished job's directory: moved into `<root>/<ns>/<name>/workspace` by rename, never copied,
with its manifest, the sandbox placed whole; a taken name replaced only as a deletion would delete it.
"""

from __future__ import annotations

import contextlib
import errno as E
import fnmatch
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from controller.node import fsdelete
from controller.node.manifests import Manifests, Present, Read
from controller.node.storefs import (
    StoreError,
    check_names,
    errno_of,
    held_fd,
    open_dir,
    rename_noreplace,
    write_atomic,
)
from controller.node.tombstones import STAGE_SUFFIX, standalone_id, tombstone_name
from controller.rules.contracts import COMMANDS_DIR, MANIFEST_NAME, VOLUMES_DIR, WORKSPACE_DIR, Reason
from controller.rules.durations import MAX_INSTANT, MIN_INSTANT, format_instant, instant_or_none, shift
from controller.rules.models import Manifest, Origin


@dataclass(frozen=True)
class _Source:
    """A retain's source, held open: its parent (no link on the way), its name there, itself, and its inode."""

    path: Path  # for messages only: everything is done through the fds
    parent_fd: int
    name: str
    fd: int
    ident: tuple[int, int]


@dataclass(frozen=True)
class Refusal:
    """Why a replacing retain's deletion pipeline left the previous sandbox in place, and what to do next."""

    reason: Reason
    why: str  # who or what holds it, e.g. "in use: pid 4242 (sleep) cwd"
    next: str = "Retry once it is released, or retain under another name"


# Frees `<ns>/<name>` for a replacing retain the way a deletion would (the caller's pipeline: root lock,
# recorded orphans reaped, in-use check, tombstone, delete), given the read the store refused a pin on (the
# claim: any change since holds it); returns None once the name is free, else why it was not freed.
Replace = Callable[[str, str, Read], Refusal | None]

_EXCLUDE_MAX_DEPTH = 256  # levels --exclude walks (one open directory each); deeper sources are refused whole


class Retainer(Manifests):
    """A root's retains. A retain reads the previous sandbox of its name through the root's own `read`, as
    any reader does, and writes the new one's manifest."""

    def retain(
        self,
        source: Path,
        namespace: str,
        name: str,
        *,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None = None,
        exclude: Sequence[str] = (),
        now: datetime | None = None,
        replace: Replace | None = None,
        origin: Origin | None = None,
    ) -> Manifest:
        """Move a finished job directory into `<root>/<ns>/<name>/workspace` by rename and write its manifest.

        The sandbox is built complete (workspace + manifest) in a tombstone-named staging directory of the root
        and then renamed into place, so no reader ever sees a sandbox without its manifest, and a crash leaves
        a plain leftover tombstone the next sweep clears. A previous attempt at the same name is replaced (last
        attempt wins) only as a deletion would delete it: never a pinned one (StoreError PINNED, refused before
        anything is done to the source), and only through `replace(ns, name, read)`, the caller's deletion
        pipeline (root lock, recorded orphans reaped, in-use check, tombstone), which frees the name or says
        why not (a `Refusal`, raised as StoreError with its reason: InUse, OrphanSurvivor, RootLocked...).
        Without `replace` a taken name is refused (StoreError RenameFailed, EEXIST). `origin` goes into the
        manifest (`retain --outcome` records the outcome there, as a capture does). Exclude globs are removed
        before the staging. On any failure nothing is left in the root and the source is where it was (minus
        excluded files).
        """
        check_names(namespace, name)
        if not MIN_INSTANT <= created_at <= MAX_INSTANT:
            raise ValueError(
                f"createdAt {created_at.isoformat()} is out of range; sandkeep takes times from "
                f"{MIN_INSTANT.year} to {MAX_INSTANT.year} (give the job's real start time)"
            )
        now = now or datetime.now(UTC)
        src = Path(os.path.abspath(source))  # noqa: PTH100 (lexical; then opened with no link in any component)
        with self._open_source(src) as held:
            self._refuse_pinned(self.read(namespace, name), namespace, name, now)
            if exclude:
                _remove_excluded(held, exclude)
            return self._retain_held(held, namespace, name, job_id, created_at, retention, node, now, replace, origin)

    def retain_volume(
        self,
        entry: str,
        namespace: str,
        name: str,
        *,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None,
        origin: Origin,
        now: datetime,
    ) -> Manifest:
        """`retain` of a captured volume's workspace, `<root>/.sandkeep-volumes/<entry>/workspace` (node/capture.py),
        with its origin in the manifest: the one source inside the root a retain takes. A taken name is never
        replaced (StoreError PINNED, or RENAME_FAILED with errno EEXIST): the caller keeps it under another name."""
        if not entry or entry.startswith(".") or "/" in entry or "\0" in entry:
            raise ValueError(f"{entry!r} is not an entry of {VOLUMES_DIR}")
        check_names(namespace, name)
        src = self.path / VOLUMES_DIR / entry / WORKSPACE_DIR
        with self._open_source(src, volume=True) as held:
            return self._retain_held(held, namespace, name, job_id, created_at, retention, node, now, None, origin)

    def _retain_held(
        self,
        held: _Source,
        namespace: str,
        name: str,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None,
        now: datetime,
        replace: Replace | None,
        origin: Origin | None = None,
    ) -> Manifest:
        src = held.path
        manifest = Manifest.model_validate(
            {
                "namespace": namespace,
                "name": name,
                "jobId": job_id,
                "createdAt": _instant_ms(created_at),
                "retainUntil": None if retention is None else _instant_ms(shift(created_at, retention)),
                "keepUntil": None,
                "pinnedAt": None,
                "node": node,
                "workspace": WORKSPACE_DIR,
                "origin": origin,
            }
        )
        with held_fd(self._open()) as root_fd:
            stage = tombstone_name(f"{standalone_id()}-{STAGE_SUFFIX}"[:64], now)
            os.mkdir(stage, 0o700, dir_fd=root_fd)
            try:
                self._fill_stage(root_fd, stage, held, manifest)
                self._place(root_fd, stage, namespace, name, now, replace)
            except BaseException as err:
                self._undo_stage(root_fd, stage, held)
                if isinstance(err, OSError):
                    raise StoreError(
                        Reason.RENAME_FAILED,
                        f"sandbox {namespace}/{name}: could not retain {src} ({os.strerror(errno_of(err))} at "
                        f"{err.filename or self.path}); nothing was retained and the source is where it was",
                        errno=errno_of(err),
                        path=self.path / namespace / name,
                    ) from err
                raise
        return manifest

    @contextlib.contextmanager
    def _open_source(self, src: Path, *, volume: bool = False) -> Iterator[_Source]:
        """Hold the source: its parent opened with no link in ANY component, itself opened O_NOFOLLOW from it.

        Everything after (exclude globs, the rename into the root, the undo) goes through these fds, so a
        user who owns a directory on the way and swaps a component for a link cannot aim root's retain at
        another directory: a link anywhere is refused, and the rename is checked to have moved this inode.
        """
        try:
            parent_fd = fsdelete.open_no_symlinks(src.parent)
        except OSError as err:
            code = errno_of(err)
            link = _symlink_on(src.parent) if code in (E.ELOOP, E.ENOTDIR) else None
            symlink = link is not None
            why = f"{link} on its path is a symlink, and sandkeep never follows one; pass the real path"
            raise StoreError(
                Reason.SYMLINK if symlink else Reason.MANIFEST_ABSENT,
                f"source {src}: cannot retain it ({why if symlink else os.strerror(code)}); "
                + ("nothing was retained" if symlink else "pass the finished job's directory"),
                errno=code,
                path=src,
            ) from err
        try:
            try:
                st = os.stat(src.name, dir_fd=parent_fd, follow_symlinks=False)
                fd = open_dir(src.name, parent_fd) if stat.S_ISDIR(st.st_mode) else -1
            except OSError as err:
                raise StoreError(
                    Reason.SYMLINK if err.errno == E.ELOOP else Reason.MANIFEST_ABSENT,
                    f"source {src}: cannot retain it ({os.strerror(errno_of(err))}); pass the finished job's directory",
                    errno=errno_of(err),
                    path=src,
                ) from err
            if fd < 0:
                reason = Reason.SYMLINK if stat.S_ISLNK(st.st_mode) else Reason.NOT_A_DIRECTORY
                raise StoreError(
                    reason,
                    f"source {src}: refused, it is {'a symlink' if reason is Reason.SYMLINK else 'not a directory'}; "
                    "pass the job's directory itself",
                    path=src,
                )
            with held_fd(fd):
                held = _Source(src, parent_fd, src.name, fd, (st.st_dev, st.st_ino))
                self._check_source(held, volume)
                yield held
        finally:
            os.close(parent_fd)

    def _check_source(self, held: _Source, volume: bool = False) -> None:
        src = held.path
        st = os.fstat(held.fd)
        root = self.path.stat()
        if (st.st_dev, st.st_ino) != held.ident:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"source {src}: it was replaced while being opened; nothing was retained, retain it again",
                path=src,
            )
        # The path has no link in it (open_no_symlinks), so the lexical comparison is the real one.
        inside = src == self.path or self.path in src.parents or src in self.path.parents
        if inside and not (volume and src.parent.parent == self.path / VOLUMES_DIR):
            raise StoreError(
                Reason.PATH_OUTSIDE_ROOT,
                f"source {src}: refused, it is the root {self.path}, inside it or above it; "
                "pass a finished job's directory outside the root",
                path=src,
            )
        if st.st_dev != root.st_dev:
            raise StoreError(
                Reason.CROSS_DEVICE,
                f"source {src}: refused, it is on another filesystem than the root {self.path}, and sandkeep "
                "retains by rename, never by copy; put job directories on the root's filesystem",
                errno=E.EXDEV,
                path=src,
            )

    def _fill_stage(self, root_fd: int, stage: str, held: _Source, manifest: Manifest) -> None:
        src = held.path
        with held_fd(open_dir(stage, root_fd)) as stage_fd:
            try:
                rename_noreplace(held.parent_fd, held.name, stage_fd, WORKSPACE_DIR)
            except OSError as err:
                code = errno_of(err)
                raise StoreError(
                    Reason.CROSS_DEVICE if code == E.EXDEV else Reason.RENAME_FAILED,
                    f"source {src}: could not move it into the root {self.path} ({os.strerror(code)}); "
                    + (
                        "sandkeep retains by rename, never by copy: put job directories on the root's filesystem"
                        if code == E.EXDEV
                        else "nothing was retained; fix the cause and retain again"
                    ),
                    errno=code,
                    path=src,
                ) from err
            moved = os.stat(WORKSPACE_DIR, dir_fd=stage_fd, follow_symlinks=False)
            if (moved.st_dev, moved.st_ino) != held.ident:
                raise StoreError(  # swapped between the open and the rename: _undo_stage puts it back
                    Reason.RENAME_FAILED,
                    f"source {src}: it was replaced while being retained; nothing was retained, retain it again",
                    path=src,
                )
            os.mkdir(COMMANDS_DIR, 0o700, dir_fd=stage_fd)
            write_atomic(stage_fd, MANIFEST_NAME, manifest.to_json().encode(), mode=0o600)

    def _place(
        self, root_fd: int, stage: str, namespace: str, name: str, now: datetime, replace: Replace | None
    ) -> None:
        """Rename the staged sandbox to `<ns>/<name>`, tombstoning (and deleting) a previous attempt first."""
        for _ in range(8):
            with contextlib.suppress(FileExistsError):
                os.mkdir(namespace, 0o700, dir_fd=root_fd)
            try:
                with held_fd(open_dir(namespace, root_fd)) as ns_fd:
                    # never onto anything, not even an empty directory (someone's cwd): a taken name is replaced
                    # only by _replace_previous, which keeps a deletion's rules
                    rename_noreplace(root_fd, stage, ns_fd, name)
                    os.fsync(ns_fd)
                    return
            except FileNotFoundError:
                continue  # the namespace directory was removed as empty meanwhile: make it again
            except OSError as err:
                if err.errno not in (E.ENOTEMPTY, E.EEXIST, E.ENOTDIR, E.EISDIR):
                    raise
            self._replace_previous(namespace, name, now, replace)
        raise StoreError(
            Reason.RENAME_FAILED,
            f"sandbox {namespace}/{name}: the name kept being taken while retaining; nothing was retained",
            path=self.path / namespace / name,
        )

    def _replace_previous(self, namespace: str, name: str, now: datetime, replace: Replace | None) -> None:
        """Free the name for the staged sandbox: a replacement is a deletion, so it keeps a deletion's rules.

        A link or a file at the name is unlinked (never followed; it is no sandbox). A directory with a live
        pin is never replaced, and any other goes only through `replace`, the caller's deletion pipeline
        (root lock, orphans, in-use, tombstone), which frees the name or refuses; without it, nothing is.
        """
        where = self.path / namespace / name
        with held_fd(self._open()) as root_fd, held_fd(open_dir(namespace, root_fd)) as ns_fd:
            try:
                st = os.lstat(name, dir_fd=ns_fd)
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=ns_fd)
                return
        read = self.read(namespace, name)
        self._refuse_pinned(read, namespace, name, now)
        if replace is None:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"sandbox {namespace}/{name}: refused to replace it, replacing a sandbox deletes it and this caller "
                "has no deletion pipeline to do that; nothing was retained and the source is where it was",
                errno=E.EEXIST,
                path=where,
            )
        refused = replace(namespace, name, read)
        if refused is not None:
            raise StoreError(
                refused.reason,
                f"sandbox {namespace}/{name}: refused to replace it ({refused.why}); nothing was retained and the "
                f"source is where it was. {refused.next}",
                path=where,
            )

    def _refuse_pinned(self, read: Read, namespace: str, name: str, now: datetime) -> None:
        """A previous sandbox with a live pin is never replaced: StoreError PINNED."""
        pinned = _live_pin(read.manifest, now) if isinstance(read, Present) else None
        if pinned is not None:
            raise StoreError(
                Reason.PINNED,
                f"sandbox {namespace}/{name}: refused to replace it, it is pinned until {format_instant(pinned)} "
                "and a pinned sandbox is never deleted; nothing was retained and the source is where it was. "
                "Unpin it (`sandkeep pin --clear`) or retain under another name",
                path=self.path / namespace / name,
            )

    def _undo_stage(self, root_fd: int, stage: str, held: _Source) -> None:
        """Put the source back where it was (renameat between held fds, never onto anything) and remove the stage."""
        with contextlib.suppress(OSError), held_fd(open_dir(stage, root_fd)) as stage_fd:
            rename_noreplace(stage_fd, WORKSPACE_DIR, held.parent_fd, held.name)
        fsdelete.delete_tree(self.path, stage)


def _instant_ms(when: datetime) -> str:
    """RFC 3339 UTC with milliseconds: two retentions of one job a moment apart never write the same bytes."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _live_pin(manifest: Manifest, now: datetime) -> datetime | None:
    """The manifest's standalone pin when it is valid and not yet lapsed."""
    until = instant_or_none(manifest.keep_until)
    return until if until is not None and until > now else None


def _symlink_on(path: Path) -> Path | None:
    """The first component of `path` that is a symlink (lstat of each prefix): for a refusal's message only."""
    for prefix in (*reversed(path.parents), path):
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(prefix).st_mode):
                return prefix
    return None


def _remove_excluded(held: _Source, patterns: Sequence[str]) -> None:
    """Delete what the exclude globs match under the held source (e.g. transcripts) before anything is retained.

    Walks from the source's fd (fsdelete.walk_entries: never a link, never a mount, memory a constant per
    level); a matched directory is deleted whole with the safe delete. A tree deeper than the walk keeps
    open is refused whole rather than retained with an exclusion missed.
    """
    by_path = any("/" in p for p in patterns)
    try:
        for found in fsdelete.walk_entries(held.fd, _EXCLUDE_MAX_DEPTH):
            rel = found.rel() if by_path else found.name
            if not _relpath_matches(rel, found.name, patterns):
                continue
            rel = found.rel()
            if found.is_dir:
                result = fsdelete.delete_tree_at(found.dir_fd, found.name, f"{held.path}/{rel.rpartition('/')[0]}")
                if not result.ok:
                    raise StoreError(
                        Reason.DELETE_FAILED,
                        f"source {held.path}: could not remove excluded {rel} ({result.describe()}); "
                        "nothing was retained",
                        errno=result.errno,
                        path=held.path / rel,
                    )
            else:
                os.unlink(found.name, dir_fd=found.dir_fd)
    except fsdelete.TooDeep as err:
        raise StoreError(
            Reason.DELETE_FAILED,
            f"source {held.path}: refused, it is {err} below it, too deep to apply --exclude to it all; "
            "nothing was retained. Retain it without --exclude, or remove the excluded files first",
            path=held.path,
        ) from err


def _relpath_matches(rel: str, base: str, patterns: Sequence[str]) -> bool:
    """A glob matches a path relative to the source, or (without a '/') any entry's own name at any depth."""
    return any(fnmatch.fnmatchcase(rel, p) or ("/" not in p and fnmatch.fnmatchcase(base, p)) for p in patterns)
