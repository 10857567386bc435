"""`sandkeep exec`: run a command in a sandbox's workspace, recording its processes; and the orphan reaper.

A command is started as the leader of a process group of its own, so killing `sandkeep exec` does not
reach it, and a background child it starts outlives it. While it runs, `sandkeep exec` walks the tree
under every recorded process (`/proc/<pid>/task/*/children`) and records the leader and each
descendant by pid, start ticks and boot id in `<sandbox>/.commands/<pid>-<start>.json` (atomic
writes); a pid alone could be reused, a pid with its start ticks on one boot cannot. The record goes
when nothing in it is alive.

`reap_orphans` ends what a killed recorder left: before a sandbox is deleted (the agent) or re-opened
(`sandkeep exec`), every record of this boot is read; the leader's whole group is SIGKILLed when the
leader is still the recorded process, and so is each recorded descendant that still is. Survivors
after the timeout hold the sandbox. Never pid <= 1 (`kill(-1)` is every process), never this process
or its own group. A record whose recorder is still alive (its lock is held) is not an orphan.
`orphan_pids` answers, without signalling, which pids a reap would end: the agent does not count them
as users of an expired sandbox, since they are killed before it is deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller import logs
from controller.contracts import COMMANDS_DIR, Reason
from controller.durations import Invalid, parse_duration

log = logging.getLogger("sandkeep.commands")

EXIT_HELD = 76  # the sandbox is held by survivors: the command was not started
EXIT_USAGE = 2
WALK_EVERY = 0.1  # seconds between walks of the command's tree while it runs
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

Kill = Callable[[int, int], None]
EXEC_KILL: list[Kill] = [os.kill]  # how `sandkeep exec` signals orphans; a test swaps it to make a survivor


@dataclass(frozen=True)
class Mark:
    """One process as recorded: a pid with its start ticks (field 22 of /proc/<pid>/stat)."""

    pid: int
    start: int


@dataclass(frozen=True)
class Survivor:
    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


@dataclass(frozen=True)
class ReapResult:
    """How many processes a reap signalled, and those still alive at its deadline (they hold the sandbox)."""

    signalled: int = 0
    survivors: tuple[Survivor, ...] = ()
    dropped: int = 0  # torn records and records of another boot, removed


# --- /proc ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stat:
    ppid: int
    pgrp: int
    start: int


def _stat(proc: Path, pid: int) -> _Stat | None:
    """`/proc/<pid>/stat` after the last `)` (the name may hold both); a zombie counts as gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split(" ")
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return _Stat(int(fields[1]), int(fields[2]), int(fields[19]))
    except ValueError:
        return None


def boot_id(proc: Path = Path("/proc")) -> str | None:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


def _children(proc: Path, pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            out.extend(int(c) for c in (task / "children").read_text().split())
    return out


def _same(proc: Path, mark: Mark) -> bool:
    """Still the recorded process: same pid, same start ticks, not a zombie; never pid 1 or below."""
    if mark.pid <= 1:
        return False
    s = _stat(proc, mark.pid)
    return s is not None and s.start == mark.start


def command_line(proc: Path, pid: int) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)[:200] or "?"


# --- records -------------------------------------------------------------------------------------------


def _record_name(leader: Mark) -> str:
    return f"{leader.pid}-{leader.start}.json"


def _lock_name(record: str) -> str:
    return record[: -len(".json")] + ".lock"


@contextlib.contextmanager
def _open_commands_dir(sandbox: Path, *, create: bool) -> Iterator[int | None]:
    """The sandbox's `.commands/` as an fd, reached without following a link; None when absent or refused.

    It must be a real directory owned by this uid and writable by nobody else: a record names processes
    the agent will SIGKILL, so one another account could write would let it aim the agent at anything.
    """
    try:
        sfd = os.open(sandbox, _DIR)
    except OSError:
        yield None
        return
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(COMMANDS_DIR, 0o700, dir_fd=sfd)
        try:
            cfd = os.open(COMMANDS_DIR, _DIR, dir_fd=sfd)
        except OSError:
            yield None
            return
        try:
            st = os.fstat(cfd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                log.warning(
                    "%s",
                    logs.fields(
                        event="commands_dir_refused",
                        reason=Reason.PATH_OUTSIDE_ROOT,
                        path=sandbox / COMMANDS_DIR,
                        uid=st.st_uid,
                        mode=oct(stat.S_IMODE(st.st_mode)),
                    ),
                )
                yield None
                return
            yield cfd
        finally:
            os.close(cfd)
    finally:
        os.close(sfd)


def _write_record(cfd: int, name: str, body: dict[str, Any]) -> None:
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=cfd)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=cfd, dst_dir_fd=cfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=cfd)
        raise


def _parse_record(text: str) -> tuple[str, Mark | None, list[Mark]] | None:
    """(boot, leader, members) of a record, or None when it is torn or not ours."""
    try:
        body = json.loads(text)
        boot = body["boot"]
        lead = body.get("leader")
        leader = None if lead is None else Mark(int(lead["pid"]), int(lead["start"]))
        members = [Mark(int(m["pid"]), int(m["start"])) for m in body.get("members", [])]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(boot, str):
        return None
    return boot, leader, members


def _body(boot: str, leader: Mark | None, members: list[Mark]) -> dict[str, Any]:
    mark = None if leader is None else {"pid": leader.pid, "start": leader.start}
    return {"boot": boot, "leader": mark, "members": [{"pid": m.pid, "start": m.start} for m in members]}


def _read_text(cfd: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=cfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(1 << 20).decode(errors="replace")


def _recorder_alive(cfd: int, record: str) -> bool:
    """A record whose `sandkeep exec` is still running (it holds the record's lock) is not an orphan."""
    try:
        fd = os.open(_lock_name(record), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cfd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _remove(cfd: int, record: str) -> None:
    for name in (record, _lock_name(record)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=cfd)


# --- the reaper ----------------------------------------------------------------------------------------


@dataclass
class _Pending:
    record: str
    boot: str
    leader: Mark | None
    members: list[Mark] = field(default_factory=list)


def _orphan_records(cfd: int, boot: str | None) -> Iterator[tuple[str, tuple[str, Mark | None, list[Mark]] | None]]:
    """Each record in `.commands` whose recorder is gone: (name, (boot, leader, members)), or (name, None)
    when it is torn or of another boot (or this boot is unknown): it names nothing on this boot.

    One reading for the reaper and for `orphan_pids`, so what is reported as an orphan is exactly what
    a reap would signal.
    """
    for name in sorted(os.listdir(cfd)):
        if not name.endswith(".json") or name.startswith("."):
            continue
        if _recorder_alive(cfd, name):
            continue
        text = _read_text(cfd, name)
        parsed = None if text is None else _parse_record(text)
        yield name, None if parsed is None or boot is None or parsed[0] != boot else parsed


def _still_recorded(proc: Path, leader: Mark | None, members: list[Mark]) -> tuple[Mark | None, list[Mark]]:
    """The leader (if it is still the recorded process) and the members that still are, leader not twice."""
    live_leader = leader if leader is not None and _same(proc, leader) else None
    live_members = [m for m in members if (leader is None or m.pid != leader.pid) and _same(proc, m)]
    return live_leader, live_members


def _never_signalled(target: int, mark: Mark, own: _Stat | None) -> bool:
    """Never pid <= 1, never this process or its group: kill(0) and kill(-1) reach far more than a record."""
    return mark.pid <= 1 or mark.pid == os.getpid() or (own is not None and target < 0 and -target == own.pgrp)


def orphan_pids(sandbox_dir: Path, proc: Path = Path("/proc")) -> frozenset[int]:
    """The pids `sandbox_dir/.commands` names that are orphans right now; read-only, nothing is signalled.

    An orphan is a process a record of this boot names, whose recorder is gone, and that is still the
    recorded process (pid, start ticks): what the next reap would SIGKILL by name. The agent uses it to
    tell a sandbox held only by such debris (reaped on the way to deletion, so it must not keep an
    expired sandbox from being deleted) from one a live command or anything else uses. Torn records,
    records of another boot and reused pids name nothing; processes a reap never signals are left out.
    """
    with _open_commands_dir(sandbox_dir, create=False) as cfd:
        if cfd is None:
            return frozenset()
        own = _stat(proc, os.getpid())
        found: set[int] = set()
        for _name, parsed in _orphan_records(cfd, boot_id(proc)):
            if parsed is None:
                continue
            leader, members = _still_recorded(proc, parsed[1], parsed[2])
            if leader is not None and not _never_signalled(-leader.pid, leader, own):
                found.add(leader.pid)
            found.update(m.pid for m in members if not _never_signalled(m.pid, m, own))
        return frozenset(found)


def reap_orphans(
    sandbox_dir: Path,
    *,
    timeout: float,
    kill: Kill = os.kill,
    proc: Path = Path("/proc"),
) -> ReapResult:
    """Kill what the records of `sandbox_dir/.commands` name that is still alive; return the survivors.

    For each record of this boot whose recorder is gone: SIGKILL the leader's group when the leader is
    still the recorded process, and each recorded member that still is; wait up to `timeout` seconds.
    Records of processes all gone are removed; a record with survivors is rewritten with just them, so
    the next reap tries again. Torn records and records of another boot are dropped. `kill` is the seam
    through which a test makes a survivor.
    """
    with _open_commands_dir(sandbox_dir, create=False) as cfd:
        if cfd is None:
            return ReapResult()
        return _reap(cfd, timeout, kill, proc)


def _reap(cfd: int, timeout: float, kill: Kill, proc: Path) -> ReapResult:
    boot = boot_id(proc)
    own = _stat(proc, os.getpid())
    signalled = dropped = 0

    def signal_once(target: int, mark: Mark) -> None:
        nonlocal signalled
        if _never_signalled(target, mark, own):
            return
        try:
            kill(target, signal.SIGKILL)
            signalled += 1
        except OSError:
            pass  # gone between the check and the kill, or not ours: a survivor if it is still alive

    pending: list[_Pending] = []
    for name, parsed in _orphan_records(cfd, boot):
        if parsed is None:
            _remove(cfd, name)  # a torn record names nothing; another boot's pids mean nothing on this one
            dropped += 1
            continue
        rboot, leader, members = parsed
        live_leader, live_members = _still_recorded(proc, leader, members)
        if live_leader is not None:
            signal_once(-live_leader.pid, live_leader)
        for m in live_members:
            signal_once(m.pid, m)
        pending.append(_Pending(name, rboot, live_leader, live_members))

    def alive() -> list[Mark]:
        return [m for p in pending for m in ([p.leader] if p.leader else []) + p.members if _same(proc, m)]

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.02)

    survivors: list[Survivor] = []
    for p in pending:
        leader = p.leader if p.leader is not None and _same(proc, p.leader) else None
        members = [m for m in p.members if _same(proc, m)]
        if leader is None and not members:
            _remove(cfd, p.record)
            continue
        survivors.extend(Survivor(m.pid, command_line(proc, m.pid)) for m in ([leader] if leader else []) + members)
        _write_record(cfd, p.record, _body(p.boot, leader, members))
    return ReapResult(signalled, tuple(survivors), dropped)


def survivors_message(where: str, survivors: tuple[Survivor, ...], timeout: float) -> str:
    """The words for a person: which processes, that SIGKILL did not end them, and what to do."""
    pids = " ".join(str(s.pid) for s in survivors)
    listed = ", ".join(str(s) for s in survivors)
    return (
        f"{where}: {len(survivors)} process(es) a killed command left are still alive {timeout:g}s after SIGKILL: "
        f"{listed}. They hold the sandbox (likely an uninterruptible wait, e.g. a hung mount). "
        f"End them (kill -9 {pids}) or wait for them; the next attempt checks again."
    )


# --- the recorder --------------------------------------------------------------------------------------


class Recorder:
    """Records one command's group (leader + every descendant seen) while it runs."""

    def __init__(self, cfd: int, leader: Mark, boot: str, proc: Path = Path("/proc")) -> None:
        self.cfd = cfd
        self.leader = leader
        self.boot = boot
        self.proc = proc
        self.members: dict[int, Mark] = {}
        self.name = _record_name(leader)
        self.dirty = True  # the record on disk lags what is known: written on the next walk (a failed write too)
        self.lock_fd = os.open(
            _lock_name(self.name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=cfd
        )
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)

    def live(self) -> list[Mark]:
        return [m for m in [self.leader, *self.members.values()] if _same(self.proc, m)]

    def walk(self) -> bool:
        """Record what is new under every live recorded process; False once nothing recorded is alive."""
        live = self.live()
        if not live:
            return False
        stack = [m.pid for m in live] + [os.getpid()]  # adopted orphans are our children (subreaper)
        seen: set[int] = set()
        while stack:
            parent = stack.pop()
            if parent in seen:
                continue
            seen.add(parent)
            for child in _children(self.proc, parent):
                s = _stat(self.proc, child)
                if s is None or child == self.leader.pid or child == os.getpid():
                    continue
                known = self.members.get(child)
                if known is None or known.start != s.start:
                    self.members[child] = Mark(child, s.start)
                    self.dirty = True
                stack.append(child)
        if self.dirty:
            _write_record(self.cfd, self.name, _body(self.boot, self.leader, list(self.members.values())))
            self.dirty = False
        return True

    def finish(self) -> None:
        """After the leader exited: keep the record while anything in it lives (the reaper's), else remove it."""
        if self.walk():
            live = self.live()
            leader = self.leader if self.leader in live else None
            _write_record(self.cfd, self.name, _body(self.boot, leader, [m for m in live if m != self.leader]))
        else:
            _remove(self.cfd, self.name)
        os.close(self.lock_fd)


# --- `sandkeep exec` -----------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    parser.add_argument("--root", type=Path, default=None, help="the node's sandbox root (required)")
    parser.add_argument(
        "--orphan-timeout",
        default=None if not top else "10s",
        help="how long to wait for a killed orphan to end (default 10s)",
    )


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    # argparse cannot take `--` inside a subcommand, so everything after the subcommand is taken whole and
    # split here: NAMESPACE/NAME and options before `--`, the command after it.
    _options(parser, top=True)
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar="NAMESPACE/NAME [--root DIR] -- CMD...", help="sandbox and command"
    )


def _split(args: argparse.Namespace) -> tuple[str, Path | None, str, list[str]] | None:
    rest = list(args.rest)
    head, argv = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest[:1], rest[1:])
    inner = argparse.ArgumentParser(prog="sandkeep exec", add_help=False, exit_on_error=False)
    inner.add_argument("sandbox")
    _options(inner, top=False)
    try:
        ns = inner.parse_args(head)
    except (argparse.ArgumentError, SystemExit):
        return None
    root = ns.root if ns.root is not None else args.root
    return ns.sandbox, root, ns.orphan_timeout or args.orphan_timeout, argv


def run(command: str, args: argparse.Namespace) -> int:
    from controller.store import Present, Root, StoreError

    split = _split(args)
    usage = "sandkeep exec: usage: sandkeep exec NAMESPACE/NAME --root DIR [--orphan-timeout 10s] -- CMD..."
    if split is None:
        _err(usage)
        return EXIT_USAGE
    target, root_dir, timeout_text, argv = split
    timeout = parse_duration(timeout_text)
    ns, _, name = target.partition("/")
    if not argv or not name or root_dir is None or isinstance(timeout, Invalid):
        _err(usage)
        return EXIT_USAGE
    try:
        root = Root(root_dir, create=False)
        sandbox = root.sandbox_path(ns, name)
        read = root.read(ns, name)
    except (StoreError, ValueError) as err:
        _err(f"sandkeep exec: {err}")
        return EXIT_USAGE
    if not isinstance(read, Present):
        _err(
            f"sandkeep exec: sandbox {ns}/{name} under {root.path}: refused, its manifest is {read.reason}; "
            "run `sandkeep ls` to see the sandboxes of this root"
        )
        return EXIT_USAGE
    reaped = reap_orphans(sandbox, timeout=timeout.total_seconds(), kill=EXEC_KILL[0])
    if reaped.signalled:
        logs.say(log, "orphans_reaped", reason=Reason.ORPHAN_REAPED, sandbox=f"{ns}/{name}", signalled=reaped.signalled)
    if reaped.survivors:
        where = f"sandkeep exec: sandbox {ns}/{name}: refused to start"
        _err(survivors_message(where, reaped.survivors, timeout.total_seconds()))
        return EXIT_HELD
    return _run_recorded(sandbox, read.manifest.workspace, argv, f"{ns}/{name}")


def _open_workspace(sandbox: Path, workspace: str) -> int:
    """The workspace directory as an fd, every component opened without following a link."""
    fd = os.open(sandbox, _DIR)
    try:
        for part in workspace.split("/"):
            if part in ("", "."):
                continue
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _become_subreaper() -> None:
    """Orphaned descendants of the command are re-parented to us instead of init, so the walk still finds
    a background child whose parent exited before the first walk saw it (PR_SET_CHILD_SUBREAPER)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)


def _reap_adopted(leader: int) -> None:
    """Collect the exit status of adopted orphans (never the leader's: Popen waits for that one)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == leader:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _run_recorded(sandbox: Path, workspace: str, argv: list[str], label: str) -> int:
    boot = boot_id()
    _become_subreaper()
    try:
        wfd = _open_workspace(sandbox, workspace)
    except OSError as err:
        _err(
            f"sandkeep exec: sandbox {label}: cannot enter its workspace {workspace!r} ({os.strerror(err.errno or 0)})"
        )
        return EXIT_USAGE
    with contextlib.ExitStack() as stack:
        stack.callback(os.close, wfd)
        cfd = stack.enter_context(_open_commands_dir(sandbox, create=True))
        try:
            # chdir through the held fd: a workspace swapped for a link after the checks is never entered
            child = subprocess.Popen(argv, cwd=f"/proc/self/fd/{wfd}", pass_fds=(wfd,), start_new_session=True)
        except OSError as err:
            _err(f"sandkeep exec: {argv[0]}: {os.strerror(err.errno or 0)}")
            return 127
        leader_stat = _stat(Path("/proc"), child.pid)
        recorder = None
        if cfd is not None and boot is not None and leader_stat is not None:
            recorder = Recorder(cfd, Mark(child.pid, leader_stat.start), boot)
        elif cfd is None:
            logs.say(log, "commands_unrecorded", level=logging.WARNING, reason=Reason.IN_USE_UNKNOWN, sandbox=label)
        previous = {sig: signal.signal(sig, _forward(child)) for sig in _FORWARDED}
        try:
            code = _wait_recording(child, recorder)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if recorder is not None:
                recorder.finish()
    return code if code >= 0 else 128 - code


def _forward(child: subprocess.Popen[bytes]) -> Callable[[int, Any], None]:
    def handler(signum: int, _frame: Any) -> None:
        # Our child is not reaped until we wait, so its pid (and group) cannot have been reused.
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

    return handler


def _wait_recording(child: subprocess.Popen[bytes], recorder: Recorder | None) -> int:
    """Walk the command's processes every WALK_EVERY until it exits. A record that cannot be written is
    said once (until a write works again) and written again on the next walk, as the reference does."""
    failing = False
    while True:
        if recorder is not None:
            try:
                recorder.walk()
                failing = False
            except OSError as err:
                if not failing:
                    logs.say(log, "record_failed", level=logging.WARNING, reason=Reason.IN_USE_UNKNOWN, error=err)
                failing = True
        _reap_adopted(child.pid)
        try:
            return child.wait(timeout=WALK_EVERY)
        except subprocess.TimeoutExpired:
            continue
        except InterruptedError:
            continue
