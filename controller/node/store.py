"""The node-side disk store: one root of retained sandboxes, its lock, its manifests and its tombstones.

Layout:

    <root>/                       owned by this process's uid, mode 0700
      .sandkeep.lock              flock: one process works on a root at a time (`Root.lock`)
      .reap-<id>-<unix-ms>        tombstones: a sandbox renamed aside before it is deleted
      .sandkeep-volumes/          captured CSI volumes (node/capture.py), one of the root's own entries
      <namespace>/<name>/         one sandbox
        manifest.json             0600, always written atomically
        workspace/                the job's files (moved here by rename, never copied)
        .commands/                records of processes started in the sandbox

`Root` is the one way in; its parts, each by job: `manifests.py` (reads and pins), `scan.py` (the listing),
`tombstones.py` (renaming aside, putting back, deleting), `retain.py` (a job's directory moved in), over
`storefs.py` (the errors and the fd-relative file operations they share).

Public API (names are stable; the node agent builds on them; all of them are importable from here):

- `RootRefused(StoreError)`: a refusal with `.reason` (a `Reason`), `.errno`, `.path`, and a message naming
  the path, what was refused, why and what to do next. `StoreError` is the base of every store failure.
- `Root(path, *, create=True)`: `.path`, `.lock(wait=None)` (context manager; `wait` seconds, None =
  forever, 0 = once), `.sandbox_path(ns, name)`, `.retain(source, ns, name, *, job_id, created_at,
  retention, node=None, exclude=(), now=None, replace=None) -> Manifest` (`replace: Replace`, a callback
  returning None or a `Refusal`, frees a taken name through the caller's deletion pipeline),
  `.retain_volume(entry, ns, name, *, job_id, created_at, retention, node, origin, now) -> Manifest` (a captured
  volume's workspace, `<root>/.sandkeep-volumes/<entry>/workspace`, with its origin; never replaces),
  `.read(ns, name) -> Read`,
  `.read_many(entries) -> {(ns, name): Read}`, `.scan() -> Scan`,
  `.pin(ns, name, until, *, now) -> Manifest` (`until=None` removes the pin), `.tombstone(ns, name, *, id,
  now) -> Tombstone`, `.read_tombstone(t) -> Read`, `.restore(t, ns, name) -> bool`, `.tombstones()`,
  `.delete_tombstone(t) -> fsdelete.DeleteResult` (sync; the agent awaits
  `fsdelete.delete_tree_async(root.path, t.name)` instead), `.remove_stray(stray) -> bool`,
  `.remove_empty_namespace(ns) -> bool`, `.lstat_entry(rel)`, `.tombstone_entry(rel, ident, *, id, now)` (any
  entry a scan names, renamed as a name and only when it is still the inode `ident`), `.read_private(name)` /
  `.write_private(name, data)` (the root's own files beside the lock), `.size(ns, name) -> int` (allocated
  bytes), `.usage(ns, name, budget) -> treesize.TreeSize(bytes, files, complete, reason)` (what the agent's
  size thread reports; linear time and bounded memory on any tree, cut short past `budget` seconds).
  Store failures raise `StoreError` (e.g. RENAME_FAILED with `.errno`); bad names raise ValueError.
- Reads: `Present(manifest, text)`, `Absent(reason)`, `Unparsed(text)`, `Unreadable(errno)`,
  `Transient(errno)`, `Mismatch(manifest, text)`; each has `.reason`. `same_read(a, b)` is the
  byte-for-byte "nothing changed" test the sweep uses before acting.
- Scan: `Scan(sandboxes: list[Entry], strays: list[Stray], tombstones: list[Tombstone], empty_namespaces)`.
- Tombstones: `Tombstone(name, id, made_at, path)` (`.pid`, `.age(now)`), `tombstone_name(id, now)`,
  `parse_tombstone(name, root=None)`, `standalone_id()` (`p<pid>n<pid namespace>-<hex>`: names the process
  that made it; a cluster uses the object's uid). `retain` stages under a tombstone name too
  (`p<pid>n<pid namespace>-<hex>-stage`), so a crash mid-retain leaves an ordinary leftover.
- `TRANSIENT_ERRNOS`: the errnos a read reports as `Transient` (held, read again next pass).
- For node/capture.py, which builds the root's volume entries the same way: `write_atomic`, `rename_noreplace`,
  `owned_fd`, `errno_of`, `ident`, `manifest_in(dir_fd, ns, name) -> Read`.

Everything below the root is reached fd-relative with O_NOFOLLOW: a symlink planted anywhere in the tree is
never followed to read, write, rename or delete a file elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from controller.node import treesize
from controller.node.manifests import (
    Absent,
    Mismatch,
    Present,
    Read,
    Transient,
    Unparsed,
    Unreadable,
    manifest_in,
    same_read,
)
from controller.node.retain import Refusal, Replace, Retainer
from controller.node.scan import Entry, Scan, Scanner, Stray
from controller.node.storefs import (
    PRIVATE,
    TRANSIENT_ERRNOS,
    RootRefused,
    StoreError,
    check_names,
    errno_of,
    held_fd,
    ident,
    open_dir,
    rename_noreplace,
    write_atomic,
)
from controller.node.tombstones import (
    Tombstone,
    Tombstones,
    parse_tombstone,
    pid_namespace,
    standalone_id,
    tombstone_name,
)
from controller.rules.contracts import LOCK_NAME, VOLUMES_DIR, Reason

__all__ = [
    "TRANSIENT_ERRNOS",
    "Absent",
    "Entry",
    "Mismatch",
    "Present",
    "Read",
    "Refusal",
    "Replace",
    "Root",
    "RootRefused",
    "Scan",
    "StoreError",
    "Stray",
    "Tombstone",
    "Transient",
    "Unparsed",
    "Unreadable",
    "errno_of",
    "ident",
    "manifest_in",
    "owned_fd",
    "parse_tombstone",
    "pid_namespace",
    "rename_noreplace",
    "same_read",
    "standalone_id",
    "tombstone_name",
    "write_atomic",
]

# The primitives node/capture.py builds its volume entries with, so both write the root one way.
owned_fd = held_fd

MAX_PRIVATE_BYTES = 4 << 20  # a private file read back larger than this is not ours: ignored


class Root(Retainer, Scanner, Tombstones):
    """One root of retained sandboxes. Every method is safe to call from a process that does not hold the lock
    (the sweep's re-reads and tombstone read-backs are what make a concurrent pin or retain safe), but only one
    process at a time should sweep a root (`lock`).

    The root itself (its owner, its lock, its own files, sizes) is here; the rest is its parts', each a class of
    its own module, by job: `Manifests` (read, read_many, read_tombstone, pin) under `Retainer` (retain),
    `Scanner` (scan, tombstones, remove_stray, remove_empty_namespace) and `Tombstones` (tombstone, restore,
    delete_tombstone, lstat_entry, tombstone_entry).
    """

    def __init__(self, path: Path | str, *, create: bool = True) -> None:
        given = Path(path)
        if create:
            try:
                given.mkdir(mode=0o700, parents=True)
                given.chmod(0o700)  # mkdir's mode passes through the umask
            except FileExistsError:
                pass
            except OSError as err:
                raise RootRefused(
                    Reason.NOT_A_DIRECTORY,
                    f"root {given}: could not create it ({os.strerror(errno_of(err))}); "
                    "create it as this process's user with mode 0700, or pick another --root",
                    errno=errno_of(err),
                    path=given,
                ) from err
        super().__init__(Path(os.path.realpath(given)))
        self._check_owner()

    def _check_owner(self) -> None:
        """Refuse a root this uid does not own: whoever owns it could swap a sandbox for a link of their own."""
        try:
            st = os.lstat(self.path)
        except OSError as err:
            raise RootRefused(
                Reason.NOT_A_DIRECTORY,
                f"root {self.path}: cannot use it ({os.strerror(errno_of(err))}); create it or pick another --root",
                errno=errno_of(err),
                path=self.path,
            ) from err
        if not stat.S_ISDIR(st.st_mode):
            raise RootRefused(
                Reason.NOT_A_DIRECTORY,
                f"root {self.path}: refused, it is not a directory; pick a directory for --root",
                path=self.path,
            )
        if st.st_uid != os.geteuid():
            raise RootRefused(
                Reason.ROOT_FOREIGN_OWNER,
                f"root {self.path}: refused, it is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); "
                "another account could swap sandboxes for links of its own. Run as its owner, or chown it to "
                f"uid {os.geteuid()} if it is yours",
                path=self.path,
            )

    # --- the lock ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, wait: float | None = None) -> Iterator[None]:
        """Hold `<root>/.sandkeep.lock` (flock) for the block; wait up to `wait` s (None: forever, 0: once).

        Raises RootRefused(ROOT_LOCKED) naming the holder's pid when the wait runs out. The lock file records
        the holder's pid for that message; the lock itself is the flock, released when the fd closes (also
        when the holder dies), so a stale pid in the file never blocks anyone.
        """
        with held_fd(self._open()) as root_fd:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
        try:
            deadline = None if wait is None else time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise self._locked(fd, wait) from None
                    time.sleep(0.05 if deadline is None else min(0.05, max(deadline - time.monotonic(), 0.001)))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def _locked(self, fd: int, wait: float | None) -> RootRefused:
        try:
            holder = os.pread(fd, 32, 0).decode().strip()
        except OSError:
            holder = ""
        who = f"process {holder}" if holder.isdigit() else "another process"
        waited = f" after waiting {wait:g}s" if wait else ""
        return RootRefused(
            Reason.ROOT_LOCKED,
            f"root {self.path}: {who} holds {LOCK_NAME}{waited}; only one sandkeep process may work on a root at "
            "a time. Wait for it to finish (or stop it), or pass a longer wait",
            path=self.path / LOCK_NAME,
        )

    # --- names -------------------------------------------------------------------------------------

    def sandbox_path(self, namespace: str, name: str) -> Path:
        """`<root>/<ns>/<name>`; ValueError when either is not a Kubernetes name (so never a dot name)."""
        check_names(namespace, name)
        return self.path / namespace / name

    # --- the root's own files ------------------------------------------------------------------------

    def read_private(self, name: str) -> bytes | None:
        """One of the root's own files (`.sandkeep-quarantine.json`): None when absent, not a regular file,
        unreadable or larger than MAX_PRIVATE_BYTES (never through a link, never a FIFO)."""
        if name not in PRIVATE:
            raise ValueError(f"{name!r} is not one of the root's own files")
        try:
            with held_fd(self._open()) as root_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
            with held_fd(fd):
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                data = os.read(fd, MAX_PRIVATE_BYTES + 1)
        except OSError:
            return None
        return data if len(data) <= MAX_PRIVATE_BYTES else None

    def write_private(self, name: str, data: bytes) -> None:
        """Replace one of the root's own files atomically (0600, beside the lock; never through a link)."""
        if name not in PRIVATE or name in (LOCK_NAME, VOLUMES_DIR):
            raise ValueError(f"{name!r} is not one of the root's own files")
        with held_fd(self._open()) as root_fd:
            write_atomic(root_fd, name, data, mode=0o600)

    # --- size --------------------------------------------------------------------------------------

    def size(self, namespace: str, name: str) -> int:
        """Bytes on disk under a sandbox (allocated blocks), walked fd-relative without following links."""
        return self.usage(namespace, name).bytes

    def usage(self, namespace: str, name: str, budget: float | None = None) -> treesize.TreeSize:
        """(allocated bytes, files, complete) under a sandbox: `treesize.tree_size`, linear time and bounded
        memory on any tree; past `budget` seconds, what was counted so far (`complete=False`)."""
        check_names(namespace, name)
        try:
            with held_fd(self._open()) as root_fd, held_fd(open_dir(namespace, root_fd)) as ns_fd:
                return treesize.tree_size(ns_fd, name, budget=budget)
        except OSError:
            return treesize.TreeSize(0, 0)
