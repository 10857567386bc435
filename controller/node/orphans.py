"""The records of the processes `sandkeep exec` runs (cli/exec.py), and the orphan reaper.

A command is started as the leader of a session of its own (setsid), so killing `sandkeep exec` does
not reach it, and a background child it starts outlives it. While it runs, `sandkeep exec` walks the
tree under every recorded process (`/proc/<pid>/task/*/children`) and records the leader and each live
descendant by pid, start ticks and boot id in `<sandbox>/.commands/<pid>-<start>.json` (atomic writes,
at most MAX_MEMBERS members); a pid alone could be reused, a pid with its start ticks on one boot
cannot. The record goes when nothing in it is alive.

`reap_orphans` ends what a killed recorder left, before a sandbox is deleted (the agent, the sweep) or
re-opened (`sandkeep exec`). A record is a claim, not a proof: anyone who can write it could name
kubelet. So a process is signalled only when, read fresh from /proc right before the signal, it is
still the recorded process, it belongs to the recorded session (its session id is the leader's pid,
or an ancestor's is) and its cwd or root is inside this sandbox (by device and inode); it is then
SIGKILLed through a pidfd opened and re-verified first, so a recycled pid is never hit. A recorded
process that is alive but not proven is never signalled and holds the sandbox (`OrphanUnproven`), as
does a record the reaper does not trust (`OrphanRecordsUntrusted`: not a regular file owned by this
uid in a `.commands` of this uid that nobody else can write) or that is over the caps
(`OrphanRecordsOverLimit`). Never pid <= 1, never this process, its group or its session. A record
whose recorder is still alive (its lock is held) is not an orphan. `orphan_pids` answers, without
signalling, which pids a reap would end: the agent does not count them as users of an expired sandbox.
"""

from __future__ import annotations

import contextlib
import errno as E
import fcntl
import json
import logging
import os
import re
import secrets
import signal
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.node.inuse import within
from controller.observe import logs
from controller.rules.contracts import COMMANDS_DIR, Reason

log = logging.getLogger("sandkeep.commands")

MAX_RECORDS = 256  # records read per sandbox and reap; beyond them the sandbox is held, nothing signalled
MAX_ENTRIES = 4 * MAX_RECORDS  # entries of `.commands` looked at (records, their locks, temp files)
MAX_MEMBERS = 1024  # processes one record names besides its leader: ~50 KB of JSON at most
MAX_RECORD_BYTES = 64 * 1024  # a longer record is not read, let alone trusted
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
_BATCH = 256  # pidfds held open at once while a reap proves, then signals, what it found
_ANCESTORS = 1024  # parent links followed to prove a process descends from the recorded session
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open
_RECORD = re.compile(r"([1-9][0-9]{0,6})-[0-9]{1,20}\.json")


@dataclass(frozen=True)
class Handle:
    """A process proven to be an orphan, ready to signal: its pidfd, or None where the kernel has none."""

    pid: int
    fd: int | None


def send(handle: Handle, sig: int) -> None:
    """Signal through the pidfd (it names that process, never a later one with its pid); os.kill without one."""
    if handle.fd is None:
        os.kill(handle.pid, sig)
    else:
        signal.pidfd_send_signal(handle.fd, sig)


Kill = Callable[[Handle, int], None]


@dataclass(frozen=True)
class Mark:
    """One process as recorded: a pid with its start ticks (field 22 of /proc/<pid>/stat)."""

    pid: int
    start: int


@dataclass(frozen=True)
class Survivor:
    """A recorded process still alive after a reap. `why` is set when it was never signalled: not proven."""

    pid: int
    command: str
    why: str | None = None

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


@dataclass(frozen=True)
class Refusal:
    """A record (or `.commands` itself, record "") the reaper does not act on: it holds the sandbox."""

    record: str
    reason: Reason
    detail: str

    def __str__(self) -> str:
        return f"{COMMANDS_DIR}/{self.record}: {self.detail}" if self.record else f"{COMMANDS_DIR}: {self.detail}"


@dataclass(frozen=True)
class ReapResult:
    """How many processes a reap signalled, those alive at its deadline, and the records it did not trust."""

    signalled: int = 0
    survivors: tuple[Survivor, ...] = ()
    dropped: int = 0  # torn records and records of another boot, removed
    refused: tuple[Refusal, ...] = ()

    @property
    def hold(self) -> Reason | None:
        """Why the sandbox must be kept (the most telling first), or None when nothing recorded holds it."""
        if self.refused:
            return self.refused[0].reason
        if any(s.why is not None for s in self.survivors):
            return Reason.ORPHAN_UNPROVEN
        return Reason.ORPHAN_SURVIVOR if self.survivors else None


# --- /proc ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stat:
    ppid: int
    pgrp: int
    sid: int
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
        return _Stat(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
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


def _untrusted(st: os.stat_result) -> str | None:
    """Why a `.commands` entry (or the directory) must not be believed: another owner, or others may write."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"mode {oct(stat.S_IMODE(st.st_mode))}: others may write it"
    return None


@contextlib.contextmanager
def _commands_dir(sandbox: Path, *, create: bool) -> Iterator[tuple[int, int] | Refusal | None]:
    """(sandbox fd, `.commands` fd), both reached without following a link; None when either is absent.

    A Refusal when `.commands` is there but not to be believed: a link, not a directory, owned by another
    uid or writable by others. A record names processes the agent will SIGKILL; it must live where only
    this uid writes, outside `workspace/` (the job's files).
    """
    try:
        sfd = os.open(sandbox, _DIR)
    except FileNotFoundError:
        yield None
        return
    except OSError as err:
        yield Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, f"the sandbox cannot be opened ({_errname(err)})")
        return
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(COMMANDS_DIR, 0o700, dir_fd=sfd)
        try:
            cfd = os.open(COMMANDS_DIR, _DIR, dir_fd=sfd)
        except FileNotFoundError:
            yield None
            return
        except OSError as err:  # ELOOP, ENOTDIR: a link or a file where the directory should be
            yield Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, f"not a directory of its own ({_errname(err)})")
            return
        try:
            why = _untrusted(os.fstat(cfd))
            yield (sfd, cfd) if why is None else Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, why)
        finally:
            os.close(cfd)
    finally:
        os.close(sfd)


@contextlib.contextmanager
def _open_commands_dir(sandbox: Path, *, create: bool) -> Iterator[int | None]:
    """The recorder's `.commands` fd, or None (said in the log) when it is absent or not to be trusted."""
    with _commands_dir(sandbox, create=create) as found:
        if isinstance(found, Refusal):
            logs.say(
                log,
                "commands_dir_refused",
                level=logging.WARNING,
                reason=found.reason,
                path=sandbox / COMMANDS_DIR,
                detail=found.detail,
            )
        yield found[1] if isinstance(found, tuple) else None


def _errname(err: OSError) -> str:
    return E.errorcode.get(err.errno or 0, str(err))


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


@dataclass(frozen=True)
class _Record:
    name: str
    boot: str
    leader: Mark | None  # None only in records written before the leader was always kept
    members: tuple[Mark, ...]
    pruned: bool = False  # members that are gone were left out: the file on disk names more

    @property
    def session(self) -> int | None:
        """The recorded session: the leader's pid (the leader called setsid), from its name in older records."""
        if self.leader is not None:
            return self.leader.pid
        named = _RECORD.fullmatch(self.name)
        return int(named.group(1)) if named else None

    def marks(self) -> list[Mark]:
        return [*([self.leader] if self.leader else []), *(m for m in self.members if m != self.leader)]

    def alive(self, look: _Memo) -> _Record:
        """This record with only its live members (the leader stays: it names the session)."""
        members = tuple(m for m in self.members if look.same(m))
        return _Record(self.name, self.boot, self.leader, members, len(members) < len(self.members))


def _mark(value: object) -> Mark | None:
    """A recorded process, or None: exact integers only (no bools, floats, strings), pids the kernel can have."""
    if not isinstance(value, dict):
        return None
    pid, start = value.get("pid"), value.get("start")
    if type(pid) is not int or type(start) is not int or not (0 < pid <= PID_MAX and 0 <= start < 1 << 64):
        return None
    return Mark(pid, start)


def _parse_record(name: str, raw: bytes) -> _Record | Refusal | None:
    """The record, a Refusal when it names more members than a recorder writes, or None when it is torn."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: `[[[[...` nested deeper than the parser goes
        return None
    if not isinstance(body, dict) or not isinstance(body.get("boot"), str):
        return None
    lead, members = body.get("leader"), body.get("members", [])
    leader = None if lead is None else _mark(lead)
    if (lead is not None and leader is None) or not isinstance(members, list):
        return None
    if len(members) > MAX_MEMBERS:
        return Refusal(
            name, Reason.ORPHAN_RECORDS_OVER_LIMIT, f"names {len(members)} processes (at most {MAX_MEMBERS})"
        )
    marks = [_mark(m) for m in members]
    if any(m is None for m in marks):
        return None
    return _Record(name, body["boot"], leader, tuple(dict.fromkeys(m for m in marks if m is not None)))


def _body(boot: str, leader: Mark | None, members: list[Mark]) -> dict[str, Any]:
    mark = None if leader is None else {"pid": leader.pid, "start": leader.start}
    return {"boot": boot, "leader": mark, "members": [{"pid": m.pid, "start": m.start} for m in members]}


def _read_record(cfd: int, name: str) -> bytes | Refusal | None:
    """A record's bytes: opened without following a link, a regular file of ours, read at most MAX_RECORD_BYTES.

    None when it went meanwhile; a Refusal when it is not to be believed or is longer than any record.
    """
    try:
        fd = os.open(name, _FILE, dir_fd=cfd)
    except FileNotFoundError:
        return None
    except OSError as err:
        return Refusal(name, Reason.ORPHAN_RECORDS_UNTRUSTED, f"cannot be opened as a file ({_errname(err)})")
    try:
        st = os.fstat(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _untrusted(st)
        if why is not None:
            return Refusal(name, Reason.ORPHAN_RECORDS_UNTRUSTED, why)
        chunks: list[bytes] = []
        got = 0
        while got <= MAX_RECORD_BYTES:
            chunk = os.read(fd, MAX_RECORD_BYTES + 1 - got)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            got += len(chunk)
        return Refusal(name, Reason.ORPHAN_RECORDS_OVER_LIMIT, f"longer than {MAX_RECORD_BYTES} bytes")
    except OSError as err:
        return Refusal(name, Reason.ORPHAN_RECORDS_UNTRUSTED, f"cannot be read ({_errname(err)})")
    finally:
        os.close(fd)


def _recorder_alive(cfd: int, record: str) -> bool:
    """A record whose `sandkeep exec` is still running (it holds the record's lock) is not an orphan."""
    try:
        fd = os.open(_lock_name(record), _FILE, dir_fd=cfd)
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


def _record_names(cfd: int) -> tuple[list[str], Refusal | None]:
    """The record names in `.commands`: at most MAX_RECORDS, from at most MAX_ENTRIES entries (the listing
    is never held whole); a Refusal when there were more, which holds the sandbox."""
    names: list[str] = []
    more = None
    with os.scandir(cfd) as entries:
        for n, entry in enumerate(entries):
            if n == MAX_ENTRIES:
                more = f"more than {MAX_ENTRIES} entries: the rest are not read"
                break
            if entry.name.endswith(".json") and not entry.name.startswith("."):
                if len(names) == MAX_RECORDS:
                    more = f"more than {MAX_RECORDS} records: the rest are not read"
                    break
                names.append(entry.name)
    return sorted(names), None if more is None else Refusal("", Reason.ORPHAN_RECORDS_OVER_LIMIT, more)


# --- the proof: is this process the recorded command's, inside this sandbox, right now? ----------------


class _Look:
    """/proc read anew on every question: how a process is proven right before its signal."""

    def __init__(self, proc: Path, sandbox: tuple[int, int]) -> None:
        self.proc = proc
        self.sandbox = sandbox  # (st_dev, st_ino) of the sandbox directory, held open by the reaper

    def stat(self, pid: int) -> _Stat | None:
        return _stat(self.proc, pid)

    def inside(self, pid: int) -> bool:
        """Its cwd or root is the sandbox or below it; unreadable (or gone) is not inside."""
        for link in ("cwd", "root"):
            with contextlib.suppress(OSError):
                if within(str(self.proc / str(pid) / link), self.sandbox):
                    return True
        return False


class _Memo(_Look):
    """/proc as a plan reads it: a live pid's stat, and whether it works inside the sandbox, read once per
    plan (a forged record may name one process 262,144 times)."""

    def __init__(self, proc: Path, sandbox: tuple[int, int]) -> None:
        super().__init__(proc, sandbox)
        self._stats: dict[int, _Stat] = {}  # live processes only: bounded by the node's, not by the records
        self._inside: dict[int, bool] = {}
        # The pids alive before any record is read: a recorded process started before its record was
        # written, so one not listed is gone (262,144 forged dead pids cost a set lookup each, not a read).
        self.listed = frozenset(int(e.name) for e in os.scandir(proc) if e.name.isdigit())

    def stat(self, pid: int) -> _Stat | None:
        s = self._stats.get(pid)
        if s is None:
            s = _stat(self.proc, pid)
            if s is not None:
                self._stats[pid] = s
        return s

    def same(self, mark: Mark) -> bool:
        s = self.stat(mark.pid) if mark.pid > 1 and mark.pid in self.listed else None
        return s is not None and s.start == mark.start

    def inside(self, pid: int) -> bool:
        if pid not in self._inside:
            self._inside[pid] = super().inside(pid)
        return self._inside[pid]


@dataclass(frozen=True)
class _Scope:
    """What a process must belong to: the recorded session, and not the reaper's own."""

    session: int
    since: int  # the leader's start ticks: nothing of its session started before it (0: not recorded)
    own: _Stat | None  # the reaper's own /proc stat: its group and session are never signalled


_GONE = "gone"  # a verdict: the recorded process is no longer there (exited, or its pid is another's now)


def _verdict(scope: _Scope, mark: Mark, look: _Look) -> str | None:
    """None when `mark` is the recorded process, of the recorded session, with its cwd or root inside the
    sandbox; _GONE when it is not that process any more; else why it is not proven."""
    s = look.stat(mark.pid)
    if mark.pid <= 1 or s is None or s.start != mark.start:
        return _GONE
    own = scope.own
    if mark.pid == os.getpid() or (own is not None and (s.pgrp == own.pgrp or s.sid == own.sid)):
        return "it is the reaper itself or of its own process group or session"
    if s.start < scope.since or not (s.sid == scope.session or _descends(scope, s, look)):
        return f"it is not of the recorded session {scope.session} (its session is {s.sid})"
    if not look.inside(mark.pid):
        return "neither its cwd nor its root is inside the sandbox (or they cannot be read)"
    return None


def _descends(scope: _Scope, s: _Stat, look: _Look) -> bool:
    """Whether an ancestor of the process is in the recorded session (a child that left it with setsid)."""
    pid = s.ppid
    for _ in range(_ANCESTORS):
        if pid <= 1:
            return False
        parent = look.stat(pid)
        if parent is None:
            return False
        if parent.sid == scope.session and parent.start >= scope.since:
            return True
        pid = parent.ppid
    return False


def _session_members(proc: Path, sessions: set[int]) -> dict[int, list[Mark]]:
    """Every live process of each of `sessions`, from one pass over /proc (the unrecorded ones too: a
    process started after the recorder's last walk is still of its command's session)."""
    found: dict[int, list[Mark]] = {}
    if not sessions:
        return found
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            s = _stat(proc, int(entry.name))
            if s is not None and s.sid in sessions:
                found.setdefault(s.sid, []).append(Mark(int(entry.name), s.start))
    return found


@dataclass
class _Judged:
    """One record, judged: what to signal (proven, with the scope to prove it again), and what holds."""

    record: _Record
    scope: _Scope | None
    proven: list[Mark]
    unproven: list[tuple[Mark, str]]


@dataclass
class _Plan:
    judged: list[_Judged]
    dropped: list[str]  # torn or of another boot: they name nothing on this boot
    refused: list[Refusal]
    fresh: _Look  # how a proven process is proven again right before its signal


def _plan(sfd: int, cfd: int, proc: Path) -> _Plan:
    """Read the orphan records of one sandbox (bounded) and judge every process they name; nothing signalled.

    One reading for the reaper and for `orphan_pids`, so what is reported as an orphan is exactly what a
    reap would signal. Torn records and records of another boot (or of an unknown boot) are dropped.
    """
    st = os.fstat(sfd)
    look = _Memo(proc, (st.st_dev, st.st_ino))
    plan = _Plan([], [], [], _Look(proc, look.sandbox))
    boot = boot_id(proc)
    names, over = _record_names(cfd)
    if over is not None:
        plan.refused.append(over)
    records: list[_Record] = []
    for name in names:
        if _recorder_alive(cfd, name):
            continue
        raw = _read_record(cfd, name)
        parsed = raw if not isinstance(raw, bytes) else _parse_record(name, raw)
        if isinstance(parsed, Refusal):
            plan.refused.append(parsed)
        elif isinstance(parsed, _Record) and boot is not None and parsed.boot == boot:
            records.append(parsed.alive(look))  # the dead forgotten at once: memory follows live processes
        elif raw is not None:
            plan.dropped.append(name)
    own = _stat(proc, os.getpid())
    live = {r.name: [m for m in r.marks() if look.same(m)] for r in records}
    scopes = {
        r.name: _Scope(r.session, r.leader.start if r.leader else 0, own)
        for r in records
        if r.session is not None and live[r.name]
    }
    # A session is the recorded one while a recorded process is still in it: its number cannot be reused
    # while any process is of it. Only then are its unrecorded members reached.
    anchored = {
        name
        for name, scope in scopes.items()
        if any((s := look.stat(m.pid)) is not None and s.sid == scope.session for m in live[name])
    }
    members = _session_members(proc, {scopes[name].session for name in anchored})
    for r in records:
        scope = scopes.get(r.name)
        judged = _Judged(r, scope, [], [])
        plan.judged.append(judged)
        if scope is None:  # nothing alive, or (an old record without a leader) no session to prove against
            judged.unproven = [(m, "its record names no session") for m in live[r.name]]
            continue
        recorded = set(live[r.name])
        extra = [m for m in members.get(scope.session, []) if r.name in anchored and m not in recorded]
        for m in [*live[r.name], *extra]:
            why = _verdict(scope, m, look)
            if why is None:
                judged.proven.append(m)
            elif why != _GONE and m in recorded:  # an unrecorded process that is not proven is not ours
                judged.unproven.append((m, why))
    return plan


# --- the reaper ----------------------------------------------------------------------------------------


def orphan_pids(sandbox_dir: Path, proc: Path = Path("/proc")) -> frozenset[int]:
    """The pids a reap of `sandbox_dir` would signal right now; read-only, nothing is signalled.

    An orphan is a process a record of this boot names (or of the session it records), whose recorder
    is gone, and that is proven to be that command's inside this sandbox. The agent uses it to tell a
    sandbox held only by such debris (reaped on the way to deletion, so it must not keep an expired
    sandbox from being deleted) from one a live command or anything else uses. Torn records, records of
    another boot, reused pids and processes a reap would not signal are left out.
    """
    with _commands_dir(sandbox_dir, create=False) as found:
        if not isinstance(found, tuple):
            return frozenset()
        plan = _plan(*found, proc)
        return frozenset(m.pid for j in plan.judged for m in j.proven)


def reap_orphans(
    sandbox_dir: Path,
    *,
    timeout: float,
    kill: Kill = send,
    proc: Path = Path("/proc"),
) -> ReapResult:
    """Kill what the records of `sandbox_dir/.commands` name that is proven an orphan; return what holds it.

    For each record of this boot whose recorder is gone: SIGKILL each proven process (the recorded ones
    and their session's unrecorded ones, each through a pidfd re-verified after opening), wait up to
    `timeout` seconds. Records of processes all gone are removed; a record with live processes is
    rewritten with just them, so the next reap tries again. Torn records and records of another boot
    are dropped; records not trusted, or over the caps, are left and hold the sandbox. `kill` is the seam
    through which a test makes a survivor.
    """
    with _commands_dir(sandbox_dir, create=False) as found:
        if found is None:
            return ReapResult()
        if isinstance(found, Refusal):
            return ReapResult(refused=(found,))
        sfd, cfd = found
        return _reap(_plan(sfd, cfd, proc), cfd, timeout, kill, proc)


def _held_for_signal(scope: _Scope, mark: Mark, fresh: _Look) -> Handle | str:
    """A pidfd for `mark`, opened and then proven again (the pid cannot change hands after the open), or
    why not (_GONE, or no longer proven). Only where the kernel has no pidfd_open: a proof right before kill."""
    try:
        fd = os.pidfd_open(mark.pid)
    except OSError as err:
        if err.errno != E.ENOSYS:
            return _GONE if err.errno == E.ESRCH else f"pidfd_open failed ({_errname(err)})"
        why = _verdict(scope, mark, fresh)
        return Handle(mark.pid, None) if why is None else why
    why = _verdict(scope, mark, fresh)
    if why is None:
        return Handle(mark.pid, fd)
    os.close(fd)
    return why


def _reap(plan: _Plan, cfd: int, timeout: float, kill: Kill, proc: Path) -> ReapResult:
    for name in plan.dropped:
        _remove(cfd, name)
    signalled = 0
    tried: set[Mark] = set()  # records may name one process many times: it is signalled once
    killed: set[Mark] = set()
    proven: list[tuple[_Judged, Mark]] = []
    for j in plan.judged:
        for m in j.proven:
            if m not in tried:
                tried.add(m)
                proven.append((j, m))
    # Every pidfd is opened and proven again before any signal: killing a leader first would re-parent its
    # setsid'd child, which then no longer descends from the session. At most _BATCH fds are open at once.
    for at in range(0, len(proven), _BATCH):
        held: list[tuple[Mark, Handle]] = []
        for j, m in proven[at : at + _BATCH]:
            assert j.scope is not None  # proven only within a scope
            handle = _held_for_signal(j.scope, m, plan.fresh)
            if isinstance(handle, str):
                j.unproven.append((m, handle))  # never signalled: if it is still alive, it says why
            else:
                held.append((m, handle))
        for m, handle in held:
            try:
                kill(handle, signal.SIGKILL)
                signalled += 1
                killed.add(m)
            except OSError:
                pass  # gone between the proof and the kill: a survivor if it is still alive
            finally:
                if handle.fd is not None:
                    os.close(handle.fd)

    def alive() -> list[Mark]:
        return [m for m in tried if _same(proc, m)]

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.02)

    survivors: dict[Mark, Survivor] = {}
    why = {m: w for j in plan.judged for m, w in j.unproven if m not in killed}  # never signalled: why not
    for j in plan.judged:
        live = [m for m in dict.fromkeys([*j.record.marks(), *j.proven]) if _same(proc, m)]
        if not live:
            _remove(cfd, j.record.name)
            continue
        for m in live:
            survivors.setdefault(m, Survivor(m.pid, command_line(proc, m.pid), why.get(m)))
        leader = j.record.leader
        members = [m for m in live if m != leader][:MAX_MEMBERS]  # unrecorded survivors join, within the cap
        if j.record.pruned or set(members) != set(j.record.members):  # an unchanged record is not rewritten
            _write_record(cfd, j.record.name, _body(j.record.boot, leader, members))
    return ReapResult(signalled, tuple(survivors.values()), len(plan.dropped), tuple(plan.refused))


def _some(items: tuple[Any, ...], text: Callable[[Any], str] = str, most: int = 10) -> str:
    """The first `most` of `items`, and how many more: a message stays short whatever a record named."""
    listed = ", ".join(text(i) for i in items[:most])
    return listed if len(items) <= most else f"{listed} and {len(items) - most} more"


def survivors_message(where: str, survivors: tuple[Survivor, ...], timeout: float) -> str:
    """The words for a person: which processes, that SIGKILL did not end them, and what to do."""
    pids = " ".join(str(s.pid) for s in survivors[:50])
    listed = _some(survivors)
    return (
        f"{where}: {len(survivors)} process(es) a killed command left are still alive {timeout:g}s after SIGKILL: "
        f"{listed}. They hold the sandbox (likely an uninterruptible wait, e.g. a hung mount). "
        f"End them (kill -9 {pids}) or wait for them; the next attempt checks again."
    )


def held_message(where: str, result: ReapResult, timeout: float) -> str:
    """The words for a person about whatever recorded holds a sandbox: untrusted records, unproven
    processes (never signalled) and survivors of SIGKILL, each with what to do."""
    parts: list[str] = []
    if result.refused:
        listed = _some(result.refused, most=5)
        parts.append(
            f"{where}: records of `sandkeep exec` were not acted on ({listed}). Nothing they name was signalled. "
            f"Check who wrote them, then remove them from {COMMANDS_DIR}/ (only this account may write there)"
        )
    unproven = tuple(s for s in result.survivors if s.why is not None)
    if unproven:
        listed = _some(unproven, lambda s: f"{s}: {s.why}", most=5)
        parts.append(
            f"{where}: {len(unproven)} recorded process(es) were not signalled, they could not be proven to be the "
            f"recorded command's inside this sandbox: {listed}. If they are debris, end them (kill -9 "
            f"{' '.join(str(s.pid) for s in unproven[:50])}); if not, the record is forged: remove it"
        )
    killed = tuple(s for s in result.survivors if s.why is None)
    if killed:
        parts.append(survivors_message(where, killed, timeout))
    return ". ".join(p.rstrip(".") for p in parts) + "."


# --- the recorder --------------------------------------------------------------------------------------


class Recorder:
    """Records one command's session (leader + every live descendant seen, at most MAX_MEMBERS) while it runs."""

    def __init__(
        self, cfd: int, leader: Mark, boot: str, proc: Path = Path("/proc"), *, subreaper: bool = False
    ) -> None:
        self.cfd = cfd
        self.leader = leader
        # `sandkeep exec` is the command's subreaper, so its orphans become the recorder's children and are
        # walked from it; a recorder that is not (a test's, in a process with children of its own) is not.
        self.subreaper = subreaper
        self.boot = boot
        self.proc = proc
        self.members: dict[int, Mark] = {}
        self.name = _record_name(leader)
        self.dirty = True  # the record on disk lags what is known: written on the next walk (a failed write too)
        self.full = False  # MAX_MEMBERS reached once: said once; the reaper still reaches the session's others
        self.lock_fd = os.open(
            _lock_name(self.name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=cfd
        )
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)

    def live(self) -> list[Mark]:
        return [m for m in [self.leader, *self.members.values()] if _same(self.proc, m)]

    def walk(self) -> bool:
        """Record what is new under every live recorded process, forgetting the dead (a pid with its start
        ticks never comes back), so the record stays bounded; False once nothing recorded is alive."""
        live = self.live()
        if not live:
            return False
        live_members = {m.pid: m for m in live if m != self.leader}
        if len(live_members) < len(self.members):
            self.members = live_members
            self.dirty = True
        stack = [m.pid for m in live] + ([os.getpid()] if self.subreaper else [])  # adopted orphans: ours
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
                    if known is None and len(self.members) >= MAX_MEMBERS:
                        self._say_full()
                        continue
                    self.members[child] = Mark(child, s.start)
                    self.dirty = True
                stack.append(child)
        if self.dirty:
            _write_record(self.cfd, self.name, _body(self.boot, self.leader, list(self.members.values())))
            self.dirty = False
        return True

    def _say_full(self) -> None:
        if not self.full:
            self.full = True
            logs.say(
                log,
                "record_full",
                level=logging.WARNING,
                reason=Reason.ORPHAN_RECORDS_OVER_LIMIT,
                record=self.name,
                members=MAX_MEMBERS,
                action="later processes are not recorded; those of the command's session are still reaped",
            )

    def finish(self) -> None:
        """After the leader exited: keep the record while anything in it lives (the reaper's), else remove it.
        The leader stays in it, alive or not: its pid is the session the reaper proves membership by."""
        if self.walk():
            live = self.live()
            _write_record(self.cfd, self.name, _body(self.boot, self.leader, [m for m in live if m != self.leader]))
        else:
            _remove(self.cfd, self.name)
        os.close(self.lock_fd)
