"""Safe deletion of a directory tree: fd-relative, never follows a link, never leaves the tree, never crosses a mount.

Public API:

- `delete_tree(parent, name) -> DeleteResult`: delete `<parent>/<name>` (a directory, or a single non-directory
  entry, which is unlinked). Idempotent: an absent name is success.
- `delete_tree_at(parent_fd, name) -> DeleteResult`: the same below an open directory fd.
- `async delete_tree_async(parent, name) -> DeleteResult`: runs it in a worker thread so the calling event loop
  keeps running (the measured stall is in docs/benchmarks.md).
- `DeleteResult(ok, reason, errno, path, files)`: on failure `reason` is DELETE_FAILED or CROSS_DEVICE and
  `path`/`errno` name the first entry that would not go; everything else that could go is gone.

A directory goes to the compiled walker (`sandkeep-rmtree`, rmtree/main.go) where it is built beside the
interpreter (`make venv`, the image) or named by `SANDKEEP_RMTREE` (empty: never): the same rules as below, step
for step, with its unlinks in flight in goroutines that share no interpreter lock (measured in
docs/benchmarks.md). It inherits the parent's fd, answers one JSON line, and dies with its caller
(PDEATHSIG); what it cannot answer is a failure of the whole tree. A failure's path past 4 KiB comes back as
`.../` and its deepest names. The walkers of one process share `WORKERS`
goroutines (`_Slots`; a delete that finds none left still walks with one); a walker holds at most 16 levels
open per goroutine, an 8 KiB read buffer per open level and 32 names per job in hand. Without it, this
module's threads delete.

Every directory is opened with O_DIRECTORY|O_NOFOLLOW relative to its parent's fd (`nofollow.py`) and read with
scandir (whose d_type spares an lstat per file); links are unlinked like files, never traversed. A directory on
another device or another mount (its mount id differs from the parent's: a bind mount keeps st_dev but not the
mount id) is refused with CROSS_DEVICE instead of entered, and so is one whose mount id cannot be read: unknown
is a mount. `treesize.py` measures a tree the same safe way.

With `workers > 1` every level a walk holds open is shared: the process's helper threads (`delete_helpers.py`)
take batches of its entries from its one reader, as the walk itself does, and remove them through the level's
fd; a subdirectory a helper takes becomes one more walk of the same kind, whose levels are shared in turn. A
level's fd stays open, and the level is not left, until no helper works on what it took from it. The unlink of
a synced file waits on the disk (on a `discard` mount, for its blocks' discard), so the disk, not the GIL, sets
how many overlap: the helpers double while levels wait for them and the process leaves CPU idle, up to
`delete_helpers.MAX_THREADS` in the process, and one a delete at most `workers - 1` (measured in
docs/benchmarks.md).

Memory is a constant per open level, whatever the depth, the width or the names: a level is a small frame
holding its own name, a link to its parent and a lazy directory iterator (never a listing, never a path; paths
are built from the links only for a message), and at most `_BATCH` names in hand per thread. No walk recurses.
The caller's walk keeps at most `MAX_OPEN` levels open and a helper's `_HELPER_OPEN` (beyond, the shallowest
level no helper works on is closed; a thread that waits on a level helps once more, never twice), two
descriptors each: with the defaults at most 76 per delete in progress and 20 per helper thread. A parent whose
fd was closed is reopened through `..`, checked to be the same inode, and read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as E
import itertools
import json
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from controller.node.delete_helpers import Helpers
from controller.node.nofollow import OPEN_DIR, mount_id
from controller.node.nofollow import open_no_symlinks as open_no_symlinks  # store.py opens a source with it from here
from controller.node.walker import MAX_OPEN, Frame, Stop, Walker, is_dir
from controller.node.walker import TooDeep as TooDeep  # the store walks its exclude globs with these from here
from controller.node.walker import walk_entries as walk_entries
from controller.rules.contracts import Reason

WORKERS = 32  # threads one delete may use at once, its caller's included; 1 = one plain walk
_HELPER_OPEN = 4  # levels a helper's walk holds open (the caller's walk holds MAX_OPEN)
_MAX_FAILED_DIRS = 1 << 16  # directories that would not go, remembered to skip on a re-read; beyond: stop
_FIRST = 4  # names of non-directories taken from a level at first (a level of fewer is never shared)
_BATCH = 32  # most names of non-directories taken from a level at once, by its walk or a helper
COMPILED = "sandkeep-rmtree"  # the compiled walker (rmtree/), beside the interpreter: `make venv`, the image
_OUTPUT_LIMIT = 1 << 16  # bytes of the walker's answer parsed at most (it shortens a path past 4 KiB itself)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeleteResult:
    ok: bool
    reason: Reason
    errno: int | None = None
    path: str | None = None
    files: int = 0  # non-directory entries removed (files, links, sockets...)

    def describe(self) -> str:
        """Words for a log line or an error: what would not go and why."""
        if self.ok:
            return f"deleted ({self.files} files)"
        why = os.strerror(self.errno) if self.errno is not None else str(self.reason)
        return f"{self.reason}: {self.path or '?'}: {why}"


class _Delete:
    """What every thread of one delete shares: where it started, what went, the first failure, the directories
    that stay, and how many helpers may work on it at once."""

    def __init__(self, parent_fd: int, where: str, helpers: int) -> None:
        self.parent_fd, self.where = parent_fd, where
        self.place = (os.fstat(parent_fd).st_dev, mount_id(parent_fd))
        self.helpers = helpers  # helper threads at once on its levels; 0: its caller walks it alone
        self.helping = 0  # under the helpers' lock
        self.lock = threading.Lock()
        self.files = 0
        self.failure: tuple[Reason, int | None, str] | None = None
        self.failed_dirs: set[int] = set()  # inodes of directories that stay: skipped when a level is read again
        self.stopped = False  # a walk met a tree it cannot safely go on in: every thread winds down

    def result(self) -> DeleteResult:
        if self.failure is None:
            return DeleteResult(True, Reason.DELETED, files=self.files)
        reason, code, path = self.failure
        return DeleteResult(False, reason, code, path, self.files)


class _Walk(Walker):
    """One thread's part of a deletion: it removes what it takes, counts what went, records the first failure
    in the shared `_Delete`, and keeps going around it."""

    def __init__(self, delete: _Delete, budget: int = MAX_OPEN) -> None:
        super().__init__(delete.parent_fd, delete.where, delete.place)
        self.delete = delete
        self.budget = budget
        self.files = 0

    def shared(self) -> _Delete | None:
        return self.delete if self.delete.helpers else None

    def fail(self, reason: Reason, code: int | None, frame: Frame | None, name: str | None = None) -> None:
        with self.delete.lock:
            if self.delete.failure is None:
                self.delete.failure = (reason, code, self.path_of(frame, name))

    def stays(self, ino: int) -> None:
        self.delete.failed_dirs.add(ino)
        if len(self.delete.failed_dirs) > _MAX_FAILED_DIRS:
            raise Stop(None, None)

    def count(self) -> None:
        """Add what this walk removed to the delete's count."""
        with self.delete.lock:
            self.delete.files += self.files
        self.files = 0

    # --- entering a directory ----------------------------------------------------------------------

    def enter(self, parent: Frame | None, name: str, ino: int | None = None) -> Frame | None:
        """Open one directory, or deal with what it turned out to be; None when not to descend."""
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        frame, err, same = self.open_dir(parent, name)
        if err is not None:
            if err.errno in (E.ELOOP, E.ENOTDIR):  # a link or a file now: unlink it, never follow it
                self.unlink(parent, name)
            elif err.errno == E.EACCES and self.make_searchable(dir_fd, name):
                return self.enter(parent, name, ino)
            elif err.errno != E.ENOENT:
                self.fail(Reason.DELETE_FAILED, err.errno, parent, name)
                if ino is not None:
                    self.stays(ino)
            return None
        assert frame is not None
        if not same:
            self.fail(Reason.CROSS_DEVICE, E.EXDEV, parent, name)
            self.stays(frame.ident[1] if ino is None else ino)
            return None
        return frame

    def make_searchable(self, dir_fd: int, name: str) -> bool:
        """A directory this uid owns but cannot read (mode 0, 0300...): give it u+rwx, through an O_PATH fd."""
        try:
            fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o700 == 0o700:
                return False
            Path(f"/proc/self/fd/{fd}").chmod(stat.S_IMODE(st.st_mode) | 0o700)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    # --- reading a level, shared with the helpers --------------------------------------------------

    def take(self, frame: Frame) -> tuple[list[str], tuple[str, int] | None]:
        """The next entries of a level this walk holds: up to `_BATCH` names of non-directories, or those read
        before a subdirectory and the subdirectory (name, inode); ([], None) once it is read out.

        A reader closed by the fd budget is opened again from the start; a new reader is shared with the
        helpers (`_HELPERS`), which take from it as this walk does.
        """
        with frame.lock:
            if frame.stash is not None:
                sub, frame.stash = frame.stash, None
                return [], sub
            if frame.it is None:
                if frame.done:
                    return [], None
                assert frame.fd is not None
                try:
                    frame.it = os.scandir(frame.fd)
                except OSError as err:
                    self.fail(Reason.DELETE_FAILED, err.errno, frame)
                    frame.done = True
                    return [], None
            taken = self.read(frame, mine=True)
            if frame.it is not None and not frame.shared and frame.delete is not None:
                _HELPERS.share(frame)  # more than one batch: worth sharing
            return taken

    def read(self, frame: Frame, mine: bool) -> tuple[list[str], tuple[str, int] | None]:
        """`take`'s reading, under `frame.lock` with its reader open (`mine`: by the level's own walk).

        Batches start at `_FIRST` names and grow to `_BATCH` as the level keeps giving, so a small level is
        shared out too. The first subdirectory a helper meets is left to the level's walk (a chain stays with the
        walk that holds the most levels open); the next ones it takes. The thread that reads the last entry
        closes the reader and stops sharing it.
        """
        assert frame.it is not None
        names: list[str] = []
        want = min(_BATCH, max(_FIRST, frame.taken >> 2))
        sub = None
        if not self.delete.stopped:
            try:
                for entry in frame.it:
                    if not is_dir(entry):
                        names.append(entry.name)
                        if len(names) < want:
                            continue
                        break
                    if not mine and frame.stash is None:
                        frame.stash = (entry.name, entry.inode())
                        continue
                    sub = (entry.name, entry.inode())
                    break
                else:
                    self.read_out(frame)
            except OSError as err:
                self.fail(Reason.DELETE_FAILED, err.errno, frame)
                self.read_out(frame)
        else:
            self.read_out(frame)
        frame.taken += len(names)
        return names, sub

    @staticmethod
    def read_out(frame: Frame) -> None:
        """The level's reader reached its end: close it and stop sharing the level (under `frame.lock`)."""
        if frame.it is not None:
            frame.it.close()  # type: ignore[attr-defined]
            frame.it = None
        frame.done = True
        _HELPERS.unshare(frame)

    def settle(self, frame: Frame) -> None:
        """Stop sharing `frame` and wait until no helper works on what it took from it (its fd stays
        valid until then: closing it earlier could let a helper unlink in whatever reuses the number).

        Meanwhile this thread helps with the delete's other shared levels, once: what it takes there never
        has it help again while it waits, so the waits nest at most two deep.
        """
        while True:
            with frame.lock:
                if frame.it is not None:
                    frame.it.close()  # type: ignore[attr-defined]
                    frame.it = None
                    frame.stash = None
                    _HELPERS.unshare(frame)
                if not frame.users:
                    return
                other = None if _waiting.helping else _HELPERS.pick(self.delete)
                if other is None:
                    if frame.cond is None:
                        frame.cond = threading.Condition(frame.lock)
                    while frame.users:
                        frame.cond.wait()
                    return
            _waiting.helping = True
            try:
                _help(other)
            finally:
                _waiting.helping = False

    def shed(self) -> None:
        """Over budget: close the shallowest open level no helper works on (the deepest is never closed)."""
        for frame in itertools.islice(self.open, len(self.open) - 1):
            with frame.lock:
                if frame.users:
                    continue
                _HELPERS.unshare(frame)
                frame.close()
                if not frame.done:
                    frame.stash = None  # read again from the start, it is met again (read out: it is kept)
            self.open.remove(frame)
            return

    def close_all(self) -> None:
        while self.open:
            frame = self.open.pop()
            self.settle(frame)
            frame.close()

    # --- removing ----------------------------------------------------------------------------------

    def unlink(self, frame: Frame | None, name: str, retry: bool = True) -> bool:
        """Unlink one non-directory; False when it turned out to be a directory (the caller descends)."""
        dir_fd = self.parent_fd if frame is None else frame.fd
        assert dir_fd is not None
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False
        except PermissionError as err:
            if frame is not None and retry and err.errno == E.EACCES and self.make_writable(frame):
                return self.unlink(frame, name, retry=False)
            self.fail(Reason.DELETE_FAILED, err.errno, frame, name)
            return True
        except OSError as err:
            self.fail(Reason.DELETE_FAILED, err.errno, frame, name)
            return True
        self.files += 1
        return True

    def unlink_names(self, frame: Frame, names: list[str]) -> None:
        """Unlink names of non-directories taken from `frame`; a name that fails goes again through `unlink`,
        with its usual handling (a directory now: the level is read again before it is left)."""
        assert frame.fd is not None
        done, redo = _unlink_names(frame.fd, names)
        self.files += done
        for name in redo:
            if not self.unlink(frame, name):
                frame.again = True
        if frame.delete is not None:
            _HELPERS.pace()

    def make_writable(self, frame: Frame) -> bool:
        """A read-only directory this uid owns (0500...) gets u+rwx so its entries can be removed."""
        if frame.fd is None:
            return False
        try:
            st = os.fstat(frame.fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o700 == 0o700:
                return False
            os.fchmod(frame.fd, stat.S_IMODE(st.st_mode) | 0o700)
        except OSError:
            return False
        return True

    def leave(self, frame: Frame) -> None:
        """rmdir a read-out directory from its parent (reopened through `..` if closed), then close it."""
        parent = frame.parent
        try:
            self.back_to_parent(frame)
        except Stop:
            frame.close()
            self.fail(Reason.DELETE_FAILED, E.ESTALE, parent)
            raise
        try:
            _rmdir(self, frame)
        finally:
            frame.close()

    # --- the walk ----------------------------------------------------------------------------------

    def run(self, name: str) -> None:
        top = self.enter(None, name)
        if top is not None:
            self.drain(top)

    def drain(self, top: Frame) -> None:
        """Delete everything below `top`, then `top` itself: depth-first, a batch of names in hand at a time.

        Each level is left only once no helper works on what it took from it; a level read again (a batched
        name was a directory) is shared again.
        """
        frame = top
        try:
            while True:
                names, sub = self.take(frame)
                if names:
                    self.unlink_names(frame, names)
                if sub is not None:
                    name, ino = sub
                    if ino not in self.delete.failed_dirs:
                        child = self.enter(frame, name, ino)
                        if child is not None:
                            frame = child
                    continue
                if names:
                    continue
                self.settle(frame)
                if frame.again:  # a batched name was a directory: read the level again to descend into it
                    frame.again = frame.done = False
                    continue
                parent = frame.parent
                self.leave(frame)
                if frame is top or parent is None:
                    return
                frame = parent
        except Stop:
            self.delete.stopped = True
        finally:
            self.close_all()
            self.count()


def _help(frame: Frame) -> None:
    """A helper's turn on a shared level: take a batch of its entries and remove them (a subdirectory as one
    more walk below it, whose own levels are shared in turn)."""
    delete = frame.delete
    assert delete is not None
    walk = _Walk(delete, _HELPER_OPEN)
    with frame.lock:
        if frame.it is None:
            return
        names, sub = walk.read(frame, mine=False)
        if not names and sub is None:
            return
        frame.users += 1
    try:
        if names:
            walk.unlink_names(frame, names)
        if sub is not None and sub[1] not in delete.failed_dirs:
            child = walk.enter(frame, sub[0], sub[1])
            if child is not None:
                walk.drain(child)
    except Stop:
        delete.stopped = True
    finally:
        walk.close_all()
        walk.count()
        with frame.lock:
            frame.users -= 1
            if not frame.users and frame.cond is not None:
                frame.cond.notify_all()


def _serve(frame: Frame) -> None:
    """A helper's turn (`delete_helpers.Helpers` calls it); a helper is never lost: what raised is the
    delete's failure, and the helper goes on serving."""
    try:
        _help(frame)
    except Exception as err:
        assert frame.delete is not None
        _Walk(frame.delete).fail(Reason.DELETE_FAILED, getattr(err, "errno", None), frame)


_HELPERS = Helpers(_serve)


class _Waiting(threading.local):
    helping = False  # this thread is helping with other levels while it waits on one of its own


_waiting = _Waiting()


def _forget_helpers() -> None:
    global _HELPERS
    _HELPERS = Helpers(_serve)


os.register_at_fork(after_in_child=_forget_helpers)  # a forked child has none of the parent's threads


def delete_tree_at(parent_fd: int, name: str, where: str | None = None, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `name` below the open directory `parent_fd` (see the module docstring)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"delete_tree: {name!r} is not a single entry name")
    if where is None:
        where = str(Path(f"/proc/self/fd/{parent_fd}").readlink())
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return DeleteResult(True, Reason.DELETED)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, f"{where.rstrip('/')}/{name}")
    if stat.S_ISDIR(st.st_mode) and (binary := compiled_walker()) is not None:
        return _delete_compiled(binary, parent_fd, name, where, workers)
    delete = _Delete(parent_fd, where, max(workers - 1, 0))
    walk = _Walk(delete)
    if not stat.S_ISDIR(st.st_mode):
        walk.unlink(None, name)
        walk.count()
    else:
        walk.run(name)
    return delete.result()


def compiled_walker() -> str | None:
    """The compiled walker to delete directories with, or None for this module's threads.

    `SANDKEEP_RMTREE` names it (empty: none); unset, it is `sandkeep-rmtree` beside the interpreter, where
    `make venv` and the image put it, when it is there.
    """
    chosen = os.environ.get("SANDKEEP_RMTREE")
    if chosen is not None:
        return chosen or None
    beside = Path(sys.executable).parent / COMPILED
    return str(beside) if os.access(beside, os.X_OK) else None


def _delete_compiled(binary: str, parent_fd: int, name: str, where: str, workers: int) -> DeleteResult:
    """Delete the directory `name` below `parent_fd` with the compiled walker (rmtree/main.go says how it keeps
    this module's rules). What it cannot answer is a failure of the whole tree, never a success."""
    top = f"{where.rstrip('/')}/{name}"
    try:
        with _SLOTS.take(workers) as goroutines:
            command = [binary, str(parent_fd), name, str(goroutines)]
            proc = subprocess.run(command, pass_fds=(parent_fd,), stdin=subprocess.DEVNULL, capture_output=True)
    except OSError as err:
        log.error("delete of %s: the compiled walker %s did not start: %s", top, binary, err)
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, top)
    answer = _answer(proc)
    if answer is None:
        why = proc.stderr[-2000:].decode(errors="replace").strip()
        log.error("delete of %s: the compiled walker %s exited %d, no answer: %s", top, binary, proc.returncode, why)
        return DeleteResult(False, Reason.DELETE_FAILED, None, top)
    files, errno, path, mount = answer
    if path is None:
        return DeleteResult(True, Reason.DELETED, files=files)
    reason = Reason.CROSS_DEVICE if mount else Reason.DELETE_FAILED
    return DeleteResult(False, reason, errno, f"{where.rstrip('/')}/{path}", files)


class _Slots:
    """The goroutines the compiled walkers of this process may run, all deletes together: `WORKERS`, as the
    threads' helpers are capped in the process; a delete that finds none left still gets one (its own walk)."""

    def __init__(self, total: int) -> None:
        self.total, self.used, self.lock = total, 0, threading.Lock()

    @contextlib.contextmanager
    def take(self, workers: int) -> Iterator[int]:
        with self.lock:
            got = max(1, min(workers, self.total - self.used))
            self.used += got
        try:
            yield got
        finally:
            with self.lock:
                self.used -= got


_SLOTS = _Slots(WORKERS)


def _answer(proc: subprocess.CompletedProcess[bytes]) -> tuple[int, int | None, str | None, bool] | None:
    """(files, errno, path, mount) from the compiled walker's one JSON line; None when it gave none."""
    if proc.returncode != 0:
        return None
    try:
        answer = json.loads(proc.stdout[:_OUTPUT_LIMIT])
        return int(answer["files"]), answer["errno"], answer["path"], bool(answer["mount"])
    except (ValueError, TypeError, KeyError):
        return None


def _unlink_names(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
    """(how many went, the names that failed for any reason but being gone already): one batch's unlinks."""
    done, redo = 0, []
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError:
            redo.append(name)
            continue
        done += 1
    return done, redo


def _rmdir(walk: _Walk, frame: Frame) -> None:
    """rmdir a read-out `frame` from its parent; a parent without write permission (ours) is made writable once."""
    parent = frame.parent
    parent_fd = walk.parent_fd if parent is None else parent.fd
    assert parent_fd is not None
    try:
        os.rmdir(frame.name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno == E.EACCES and parent is not None and walk.make_writable(parent):
            with contextlib.suppress(OSError):
                os.rmdir(frame.name, dir_fd=parent_fd)
                return
        if walk.delete.failure is None or err.errno != E.ENOTEMPTY:
            walk.fail(Reason.DELETE_FAILED, err.errno, frame)
        walk.stays(frame.ident[1])


def delete_tree(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `<parent>/<name>`; `parent` is trusted (resolved once), nothing below it is followed."""
    where = os.path.realpath(parent)
    try:
        fd = os.open(where, OPEN_DIR)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, where)
    try:
        return delete_tree_at(fd, name, where, workers=workers)
    finally:
        os.close(fd)


async def delete_tree_async(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """`delete_tree` in a worker thread: the event loop keeps ticking while a large tree goes."""
    return await asyncio.to_thread(delete_tree, parent, name, workers=workers)
