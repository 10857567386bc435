"""Whether anything on the node uses a sandbox: one pass over `/proc` for every sandbox asked about.

A sandbox is in use when a process has its cwd, root, executable, an open file, a mapped file or a
mount inside it, or a Pod on the node mounts it through a hostPath volume. The answer has three
values: a process the agent cannot inspect (EACCES/EPERM on a live process, or any other failure to
read its links or its mountinfo, EMFILE included), or the scan's own mountinfo that cannot be read,
makes every sandbox not already known to be in use UNKNOWN, and unknown holds, because deleting a
directory someone still uses is the one mistake that cannot be undone. A process that exits mid-scan
is simply gone.
"""

from __future__ import annotations

import bisect
import errno
import os
import stat
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from controller.node.nofollow import unescape_mountinfo
from controller.rules.contracts import Reason

K = TypeVar("K")

# A readlink/listdir that fails with these means the process (or that fd) ended under us: not an error.
_GONE = {errno.ENOENT, errno.ESRCH, errno.ENOTDIR}
_DELETED = " (deleted)"


@dataclass(frozen=True)
class Usage:
    """One sandbox's answer: `in_use` is True, False, or None (unknown: holds like True)."""

    in_use: bool | None
    holders: tuple[str, ...] = ()
    reason: Reason | None = None
    pids: frozenset[int] = frozenset()  # the processes among the holders (Pods, mounts, unknowns carry none)
    only_pids: bool = False  # nothing but those processes holds: no Pod, no mount, nothing uninspectable

    @property
    def holds(self) -> bool:
        """Whether this answer must keep the sandbox from being renamed or deleted."""
        return self.in_use is not False

    def held_only_by(self, pids: Collection[int]) -> bool:
        """Whether every holder is one of `pids` (and no process that could not be inspected might hold it).

        How the agent tells a sandbox used only by processes it is about to kill (recorded orphans) from
        one in use: anything else among the holders, or anything unknown on the node, keeps it in use.
        """
        return self.in_use is True and self.only_pids and bool(self.pids) and self.pids <= frozenset(pids)


@dataclass
class _Found(Generic[K]):
    procs: dict[K, list[str]] = field(default_factory=dict)
    pids: dict[K, set[int]] = field(default_factory=dict)  # the process behind each of procs' holders...
    not_pids: set[K] = field(default_factory=set)  # ...except these keys': a holder without one (a mount)
    pods: dict[K, list[str]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def hold(self, key: K, holder: str, pid: int | None) -> None:
        self.procs.setdefault(key, []).append(holder)
        if pid is None:
            self.not_pids.add(key)
        else:
            self.pids.setdefault(key, set()).add(pid)


@dataclass(frozen=True)
class _Mount:
    dev: str  # major:minor
    root: str  # the mounted path inside its filesystem
    point: str  # where it is mounted, in the reading namespace


class _Index(Generic[K]):
    """Canonical sandbox paths, looked up by walking a target's ancestors (depth, not sandbox count)."""

    def __init__(self, paths: Mapping[K, Path]) -> None:
        self.by_path: dict[str, list[K]] = {}
        parents: dict[str, str] = {}
        for key, path in paths.items():
            self.by_path.setdefault(_canonical(path, parents), []).append(key)

    def owners(self, target: str) -> list[K]:
        return _owners(self.by_path, target)


def _owners(by_path: Mapping[str, list[K]], target: str) -> list[K]:
    """The sandboxes at or above `target`, by walking its ancestors through `by_path`."""
    if target.endswith(_DELETED):
        target = target[: -len(_DELETED)]
    if not target.startswith("/"):
        return []  # socket:[..], pipe:[..], anon_inode:..: not a path
    found: list[K] = []
    probe = target.rstrip("/") or "/"
    while True:
        found.extend(by_path.get(probe, ()))
        if probe == "/":
            return found
        probe = probe.rsplit("/", 1)[0] or "/"


def _canonical(path: Path, parents: dict[str, str]) -> str:
    """realpath, resolving each parent directory once: thousands of sandboxes share a few parents."""
    text = os.path.abspath(path)  # noqa: PTH100 (no resolving here: only the parents are resolved)
    head, _, name = text.rpartition("/")
    if not name or Path(text).is_symlink():
        return os.path.realpath(text)
    if head not in parents:
        parents[head] = os.path.realpath(head or "/")
    return f"{parents[head].rstrip('/')}/{name}"


def _mounts(text: str) -> list[_Mount]:
    mounts = []
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) >= 5:
            mounts.append(_Mount(parts[2], unescape_mountinfo(parts[3]), unescape_mountinfo(parts[4])))
    return mounts


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _fs_location(path: str, mounts: list[_Mount]) -> tuple[str, str] | None:
    """(device, path inside that filesystem) of `path`, from the mount that holds it in our namespace."""
    best = max((m for m in mounts if _inside(path, m.point)), key=lambda m: len(m.point), default=None)
    if best is None:
        return None
    rel = path[len(best.point.rstrip("/")) :].lstrip("/")
    return best.dev, f"{best.root.rstrip('/')}/{rel}" if rel else best.root


def _ancestors_in(
    directory: str, ids: Mapping[tuple[int, int], list[K]], memo: dict[tuple[int, int], list[K]]
) -> list[K]:
    """The sandboxes among `directory` and its ancestors, found by `..` from an O_PATH descriptor.

    Every directory passed on the way is remembered in `memo` with the answer, so the dozens of fds a
    deep delete holds along one chain cost one walk of it, not one each.
    """
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    passed: list[tuple[int, int]] = []
    answer: list[K] = []
    fd = os.open(directory, flags)
    try:
        here = os.fstat(fd)
        while True:
            node = (here.st_dev, here.st_ino)
            if node in memo:
                answer = memo[node]
                break
            passed.append(node)
            if node in ids:
                answer = list(ids[node])
                break
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            above = os.fstat(fd)
            if (above.st_dev, above.st_ino) == node:
                break  # `..` of the root is the root: no sandbox above
            here = above
    finally:
        os.close(fd)
    for node in passed:
        memo[node] = answer
    return answer


def _code(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e))


def _comm(pid_dir: Path) -> str:
    try:
        return (pid_dir / "comm").read_text().strip()
    except OSError:
        return "?"


class _Scan(Generic[K]):
    """The state of one pass: the index, what was found, and the namespaces already read."""

    def __init__(self, paths: Mapping[K, Path], proc: Path) -> None:
        self.index = _Index(paths)
        self.found: _Found[K] = _Found()
        self.proc = proc
        self.seen_ns: set[str] = set()
        self._ids: dict[tuple[int, int], list[K]] | None = None
        self._deep: dict[tuple[int, int], list[K]] = {}
        try:
            own = (proc / "self" / "mountinfo").read_text()
        except OSError as e:  # EMFILE, EACCES, ENOENT...: no mount can be ruled out, so nothing is free
            own = ""
            self.found.unknown.append(f"the scan's own mountinfo cannot be read: {_code(e)}")
        self.own_mounts = _mounts(own)
        # (device, path inside its filesystem) -> sandbox paths: how a bind in any namespace is recognised.
        self.by_fs: dict[tuple[str, str], list[str]] = {}
        points = {m.point for m in self.own_mounts}
        parent_loc: dict[str, tuple[str, str] | None] = {}
        for path in self.index.by_path:
            head, _, name = path.rpartition("/")
            if path in points or not head:
                loc = _fs_location(path, self.own_mounts)
            else:
                if head not in parent_loc:
                    parent_loc[head] = _fs_location(head, self.own_mounts)
                base = parent_loc[head]
                loc = None if base is None else (base[0], f"{base[1].rstrip('/')}/{name}")
            if loc is not None:
                self.by_fs.setdefault(loc, []).append(path)
        self.devs = {dev for dev, _ in self.by_fs}
        own_ns = self._link(proc / "self" / "ns" / "mnt")
        self.own_ns = own_ns
        if own_ns is not None:
            self.seen_ns.add(own_ns)
        # Another mount namespace's paths: sandbox paths as that namespace sees them (see `_view`).
        self.views: dict[str, dict[str, list[K]]] = {}
        self.fs_sorted = sorted(self.by_fs)
        self._check_mounts(self.own_mounts, "the agent's mount namespace", own_namespace=True)

    @staticmethod
    def _link(path: Path) -> str | None:
        """A /proc link's target; None when it is gone (a zombie has no namespace), any other failure raises."""
        try:
            return str(path.readlink())
        except OSError as e:
            if e.errno in _GONE:
                return None
            raise

    def hold(self, target: str, holder: str, view: Mapping[str, list[K]] | None = None, pid: int | None = None) -> None:
        keys = self.index.owners(target)
        if view:
            keys = keys + _owners(view, target)
        for key in dict.fromkeys(keys):
            self.found.hold(key, holder, pid)

    def _view(self, mounts: list[_Mount]) -> dict[str, list[K]]:
        """Where the sandboxes appear in a namespace that mounts one of their ancestors elsewhere.

        A container that binds the whole root (or a namespace directory) at `/data` has its cwd and
        files under `/data/<ns>/<name>`, which the host's paths never match. Each such mount maps the
        sandboxes below its source to paths under its mount point; identical paths are left to the
        host index.
        """
        view: dict[str, list[K]] = {}
        for m in mounts:
            if m.dev not in self.devs:
                continue
            top = m.root.rstrip("/")
            prefix = f"{top}/"  # everything strictly below the mount's source: one contiguous sorted run
            start = bisect.bisect_left(self.fs_sorted, (m.dev, prefix))
            below = []
            for dev, fs_path in self.fs_sorted[start:]:
                if dev != m.dev or not fs_path.startswith(prefix):
                    break
                below.append(fs_path)
            if (m.dev, top or "/") in self.by_fs:
                below.append(top or "/")
            for fs_path in below:
                seen_as = f"{m.point.rstrip('/')}{fs_path[len(top) :]}" or "/"
                for host_path in self.by_fs[(m.dev, fs_path)]:
                    if seen_as != host_path:
                        view.setdefault(seen_as, []).extend(self.index.by_path[host_path])
        return view

    def hold_deep(self, link: str, holder: str, pid: int) -> None:
        """A /proc link whose target path is longer than PATH_MAX (ENAMETOOLONG): decide by identity.

        readlink cannot name such a target, but the kernel still resolves the link: a directory is
        walked up by `..`, comparing (device, inode) with the sandboxes' directories. A file stays
        unknown (which holds). Without this, one process with a deep directory open anywhere (a build,
        a delete of a deep tree) made every sandbox on the node unknown.
        """
        try:
            st = Path(link).stat()
        except OSError as e:
            if e.errno in _GONE:
                return
            raise
        if not stat.S_ISDIR(st.st_mode):
            # a file cannot be walked up from: where it sits stays unknown, which holds
            raise OSError(errno.ENAMETOOLONG, "a file deeper than PATH_MAX", link)
        for key in _ancestors_in(link, self._sandbox_ids(), self._deep):
            self.found.hold(key, f"{holder} (deeper than PATH_MAX)", pid)

    def _sandbox_ids(self) -> dict[tuple[int, int], list[K]]:
        """(device, inode) of every sandbox directory, stat-ed once per scan and only when needed."""
        if self._ids is None:
            self._ids = {}
            for path, keys in self.index.by_path.items():
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                self._ids.setdefault((st.st_dev, st.st_ino), []).extend(keys)
        return self._ids

    def _check_mounts(self, mounts: list[_Mount], whose: str, *, own_namespace: bool) -> None:
        """A bind of a sandbox (or of anything inside one) anywhere, or a mount on a directory inside one."""
        for m in mounts:
            if m.dev not in self.devs:
                continue
            for path in self._sandboxes_above(m.dev, m.root):
                if own_namespace and _inside(path, m.point):
                    continue  # the mount that holds the sandbox itself (the root's filesystem), not a bind of it
                for key in self.index.by_path[path]:
                    self.found.hold(key, f"{whose} mounts {m.root} at {m.point}", None)  # outlives any one pid
        if own_namespace:
            for m in mounts:
                self.hold(m.point, f"mount at {m.point}")

    def _sandboxes_above(self, dev: str, fs_path: str) -> list[str]:
        """Sandboxes at or above `fs_path` on `dev`: a mount of that path exposes (part of) them."""
        found: list[str] = []
        probe = fs_path.rstrip("/") or "/"
        while True:
            found.extend(self.by_fs.get((dev, probe), ()))
            if probe == "/":
                return found
            probe = probe.rsplit("/", 1)[0] or "/"

    def process(self, pid: int) -> None:
        pid_dir = self.proc / str(pid)
        try:
            self._process(pid, pid_dir)
        except OSError as e:
            if e.errno in _GONE or not pid_dir.exists():
                return
            # Denied (or any other failure: EMFILE too) on a live process: what it holds is unknown, which holds.
            self.found.unknown.append(f"pid {pid} ({_comm(pid_dir)}) cannot be inspected: {_code(e)}")

    def _process(self, pid: int, pid_dir: Path) -> None:
        comm = _comm(pid_dir)
        who = f"pid {pid} ({comm})"
        ns = self._link(pid_dir / "ns" / "mnt")
        if ns is not None and ns not in self.seen_ns:
            # A failed read raises (unknown, or skipped when the process is gone) and leaves the namespace
            # unseen, so the next process in it reads it: one that exits mid-read never hides its mounts.
            mounts = _mounts((pid_dir / "mountinfo").read_text())
            self.seen_ns.add(ns)
            self._check_mounts(mounts, f"{who} (mount namespace {ns})", own_namespace=False)
            self.views[ns] = self._view(mounts)
        view = self.views.get(ns) if ns is not None and ns != self.own_ns else None
        for what in ("cwd", "root", "exe"):
            try:
                target = str((pid_dir / what).readlink())
            except OSError as e:
                # a kernel thread has no exe, a zombie no cwd: nothing to hold
                if e.errno in _GONE:
                    continue
                if e.errno == errno.ENAMETOOLONG:
                    self.hold_deep(str(pid_dir / what), f"{who} {what}", pid)
                    continue
                raise
            self.hold(target, f"{who} {what}", view, pid)
        with os.scandir(pid_dir / "fd") as fds:
            for fd in fds:
                try:
                    target = os.readlink(fd.path)  # noqa: PTH115 (thousands per pass: no Path objects)
                except OSError as e:
                    if e.errno in _GONE:
                        continue  # closed between the listing and the readlink
                    if e.errno == errno.ENAMETOOLONG:
                        self.hold_deep(fd.path, f"{who} fd {fd.name}", pid)
                        continue
                    raise
                self.hold(target, f"{who} fd {fd.name}", view, pid)
        maps = (pid_dir / "maps").read_text()
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                self.hold(parts[5], f"{who} maps a file", view, pid)


def uninspectable_pids(proc: Path = Path("/proc")) -> frozenset[int]:
    """Processes whose links even this process cannot read (e.g. a microVM's init, or without CAP_SYS_PTRACE).

    Each one makes every answer of `scan_usage` unknown, which holds everything. The agent logs them at
    start; an operator who knows what they are vouches for them with `--ignore-pid` (the demo and the
    tests do so for this machine's supervisor).
    """
    found = set()
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                (entry / "cwd").readlink()
            except PermissionError:
                found.add(int(entry.name))
            except OSError:
                pass  # gone, or a kernel thread: neither holds a path
    return frozenset(found)


def scan_usage(
    paths: Mapping[K, Path],
    pod_paths: Iterable[tuple[str, Path]] = (),
    proc: Path = Path("/proc"),
    ignore: Collection[int] = (),
    held: Iterable[tuple[str, Path]] = (),
    unknown: Iterable[str] = (),
) -> dict[K, Usage]:
    """Answer, for every sandbox in `paths`, whether it is in use: one walk of `/proc` for all of them.

    `pod_paths` are (`namespace/name`, hostPath) of the Pods on this node. `ignore` lists pids that do
    not count as users (the agent itself, whose own size walk opens files inside sandboxes). `held` are
    other holders of a path (a reopen volume's, with its words); each of `unknown` makes every answer unknown.
    """
    scan: _Scan[K] = _Scan(paths, proc)
    scan.found.unknown.extend(unknown)
    for holder, path in held:
        for key in scan.index.owners(os.path.realpath(path)):
            scan.found.pods.setdefault(key, []).append(holder)
    for pod, host_path in pod_paths:
        # Only a hostPath AT or BELOW a sandbox: the agent's own pod mounts the whole root above them.
        for key in scan.index.owners(os.path.realpath(host_path)):
            scan.found.pods.setdefault(key, []).append(f"pod {pod} hostPath {host_path}")
    skip = set(ignore)
    for entry in os.scandir(proc):
        if entry.name.isdigit() and int(entry.name) not in skip:
            scan.process(int(entry.name))
    return {key: _answer(key, scan.found) for key in paths}


def _answer(key: K, found: _Found[K]) -> Usage:
    procs, pods = found.procs.get(key, []), found.pods.get(key, [])
    if procs or pods:
        reason = Reason.IN_USE if procs else Reason.POD_MOUNT
        pids = frozenset(found.pids.get(key, ()))
        only = bool(pids) and not pods and key not in found.not_pids and not found.unknown
        return Usage(True, _bounded(procs + pods), reason, pids, only)
    if found.unknown:
        return Usage(None, _bounded(found.unknown), Reason.IN_USE_UNKNOWN)
    return Usage(False)


MAX_HOLDERS = 32  # status.heldBy's maxItems; the rest are summarised in the last entry


def _bounded(holders: list[str]) -> tuple[str, ...]:
    """Distinct holders, each short enough for a status field, at most MAX_HOLDERS of them."""
    distinct = [h[:256] for h in dict.fromkeys(holders)]
    if len(distinct) <= MAX_HOLDERS:
        return tuple(distinct)
    return (*distinct[: MAX_HOLDERS - 1], f"... and {len(distinct) - MAX_HOLDERS + 1} more")


def pid_alive(pid: int) -> bool:
    """kill(pid, 0): alive unless ESRCH (EPERM is alive under another account)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def within(link: str, directory: tuple[int, int]) -> bool:
    """Whether the directory `link` leads to (e.g. /proc/<pid>/cwd, resolved by the kernel) is `directory`
    (st_dev, st_ino) or inside it: walked up by `..` and compared by identity, no path string trusted."""
    return bool(_ancestors_in(link, {directory: [True]}, {}))
