"""The records of the processes `sandkeep exec` runs (cli/exec.py), and the `Recorder` that keeps one.

A command is started as the leader of a session of its own (setsid), so killing `sandkeep exec` does
not reach it, and a background child it starts outlives it. While it runs, `sandkeep exec` walks the
tree under every recorded process (`/proc/<pid>/task/*/children`) and records the leader and each live
descendant by pid, start ticks and boot id in `<sandbox>/.commands/<pid>-<start>.json` (atomic writes,
at most MAX_MEMBERS members); a pid alone could be reused, a pid with its start ticks on one boot
cannot. The record goes when nothing in it is alive.

A record is read back only from a `.commands` of this uid that nobody else can write, as a regular file
of this uid, at most MAX_RECORD_BYTES, at most MAX_RECORDS of them; anything else is a `Refusal`, which
holds the sandbox. What a record's processes are proven to be, and how they are ended: orphans.py.
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
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.node.nofollow import OPEN_DIR
from controller.observe import logs
from controller.rules.contracts import COMMANDS_DIR, Reason

log = logging.getLogger("sandkeep.commands")

MAX_RECORDS = 256  # records read per sandbox and reap; beyond them the sandbox is held, nothing signalled
MAX_ENTRIES = 4 * MAX_RECORDS  # entries of `.commands` looked at (records, their locks, temp files)
MAX_MEMBERS = 1024  # processes one record names besides its leader: ~50 KB of JSON at most
MAX_RECORD_BYTES = 64 * 1024  # a longer record is not read, let alone trusted
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open
_RECORD = re.compile(r"([1-9][0-9]{0,6})-[0-9]{1,20}\.json")


@dataclass(frozen=True)
class Mark:
    """One process as recorded: a pid with its start ticks (field 22 of /proc/<pid>/stat)."""

    pid: int
    start: int


@dataclass(frozen=True)
class Refusal:
    """A record (or `.commands` itself, record "") the reaper does not act on: it holds the sandbox."""

    record: str
    reason: Reason
    detail: str

    def __str__(self) -> str:
        return f"{COMMANDS_DIR}/{self.record}: {self.detail}" if self.record else f"{COMMANDS_DIR}: {self.detail}"


# --- /proc ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    pgrp: int
    sid: int
    start: int


def proc_stat(proc: Path, pid: int) -> ProcStat | None:
    """`/proc/<pid>/stat` after the last `)` (the name may hold both); a zombie counts as gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split(" ")
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return ProcStat(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
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


def is_alive(proc: Path, mark: Mark) -> bool:
    """Still the recorded process: same pid, same start ticks, not a zombie; never pid 1 or below."""
    if mark.pid <= 1:
        return False
    s = proc_stat(proc, mark.pid)
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
def commands_dir(sandbox: Path, *, create: bool) -> Iterator[tuple[int, int] | Refusal | None]:
    """(sandbox fd, `.commands` fd), both reached without following a link; None when either is absent.

    A Refusal when `.commands` is there but not to be believed: a link, not a directory, owned by another
    uid or writable by others. A record names processes the agent will SIGKILL; it must live where only
    this uid writes, outside `workspace/` (the job's files).
    """
    try:
        sfd = os.open(sandbox, OPEN_DIR)
    except FileNotFoundError:
        yield None
        return
    except OSError as err:
        yield Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, f"the sandbox cannot be opened ({errname(err)})")
        return
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(COMMANDS_DIR, 0o700, dir_fd=sfd)
        try:
            cfd = os.open(COMMANDS_DIR, OPEN_DIR, dir_fd=sfd)
        except FileNotFoundError:
            yield None
            return
        except OSError as err:  # ELOOP, ENOTDIR: a link or a file where the directory should be
            yield Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, f"not a directory of its own ({errname(err)})")
            return
        try:
            why = _untrusted(os.fstat(cfd))
            yield (sfd, cfd) if why is None else Refusal("", Reason.ORPHAN_RECORDS_UNTRUSTED, why)
        finally:
            os.close(cfd)
    finally:
        os.close(sfd)


@contextlib.contextmanager
def open_commands_dir(sandbox: Path, *, create: bool) -> Iterator[int | None]:
    """The recorder's `.commands` fd, or None (said in the log) when it is absent or not to be trusted."""
    with commands_dir(sandbox, create=create) as found:
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


def errname(err: OSError) -> str:
    return E.errorcode.get(err.errno or 0, str(err))


def write_record(cfd: int, name: str, body: dict[str, Any]) -> None:
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
class Record:
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

    def alive(self, same: Callable[[Mark], bool]) -> Record:
        """This record with only its live members (`same`: still the recorded process); the leader stays, it
        names the session."""
        members = tuple(m for m in self.members if same(m))
        return Record(self.name, self.boot, self.leader, members, len(members) < len(self.members))


def _mark(value: object) -> Mark | None:
    """A recorded process, or None: exact integers only (no bools, floats, strings), pids the kernel can have."""
    if not isinstance(value, dict):
        return None
    pid, start = value.get("pid"), value.get("start")
    if type(pid) is not int or type(start) is not int or not (0 < pid <= PID_MAX and 0 <= start < 1 << 64):
        return None
    return Mark(pid, start)


def parse_record(name: str, raw: bytes) -> Record | Refusal | None:
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
    return Record(name, body["boot"], leader, tuple(dict.fromkeys(m for m in marks if m is not None)))


def record_body(boot: str, leader: Mark | None, members: list[Mark]) -> dict[str, Any]:
    mark = None if leader is None else {"pid": leader.pid, "start": leader.start}
    return {"boot": boot, "leader": mark, "members": [{"pid": m.pid, "start": m.start} for m in members]}


def read_record(cfd: int, name: str) -> bytes | Refusal | None:
    """A record's bytes: opened without following a link, a regular file of ours, read at most MAX_RECORD_BYTES.

    None when it went meanwhile; a Refusal when it is not to be believed or is longer than any record.
    """
    try:
        fd = os.open(name, _FILE, dir_fd=cfd)
    except FileNotFoundError:
        return None
    except OSError as err:
        return Refusal(name, Reason.ORPHAN_RECORDS_UNTRUSTED, f"cannot be opened as a file ({errname(err)})")
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
        return Refusal(name, Reason.ORPHAN_RECORDS_UNTRUSTED, f"cannot be read ({errname(err)})")
    finally:
        os.close(fd)


def recorder_alive(cfd: int, record: str) -> bool:
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


def remove_record(cfd: int, record: str) -> None:
    for name in (record, _lock_name(record)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=cfd)


def record_names(cfd: int) -> tuple[list[str], Refusal | None]:
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
        return [m for m in [self.leader, *self.members.values()] if is_alive(self.proc, m)]

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
                s = proc_stat(self.proc, child)
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
            write_record(self.cfd, self.name, record_body(self.boot, self.leader, list(self.members.values())))
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
            members = [m for m in self.live() if m != self.leader]
            write_record(self.cfd, self.name, record_body(self.boot, self.leader, members))
        else:
            remove_record(self.cfd, self.name)
        os.close(self.lock_fd)
