"""The orphan reaper: what a killed `sandkeep exec` left running is ended before its sandbox is deleted.

`sandkeep exec` records each command's processes (orphan_records.py). `reap_orphans` ends what a killed
recorder left, before a sandbox is deleted (the agent, the sweep) or re-opened (`sandkeep exec`). A
record is a claim, not a proof: anyone who can write it could name kubelet. So a process is signalled
only when, read fresh from /proc right before the signal, it is still the recorded process, it belongs
to the recorded session (its session id is the leader's pid, or an ancestor's is) and its cwd or root is
inside this sandbox (by device and inode); it is then SIGKILLed through a pidfd opened and re-verified
first, so a recycled pid is never hit. A recorded process that is alive but not proven is never
signalled and holds the sandbox (`OrphanUnproven`), as does a record the reaper does not trust
(`OrphanRecordsUntrusted`: not a regular file owned by this uid in a `.commands` of this uid that nobody
else can write) or that is over the caps (`OrphanRecordsOverLimit`). Never pid <= 1, never this process,
its group or its session. A record whose recorder is still alive (its lock is held) is not an orphan.
`orphan_pids` answers, without signalling, which pids a reap would end: the agent does not count them as
users of an expired sandbox.
"""

from __future__ import annotations

import contextlib
import errno as E
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.node import orphan_records as records
from controller.node.inuse import within
from controller.node.orphan_records import Mark, ProcStat, Record, Refusal
from controller.rules.contracts import COMMANDS_DIR, Reason

_BATCH = 256  # pidfds held open at once while a reap proves, then signals, what it found
_ANCESTORS = 1024  # parent links followed to prove a process descends from the recorded session


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
class Survivor:
    """A recorded process still alive after a reap. `why` is set when it was never signalled: not proven."""

    pid: int
    command: str
    why: str | None = None

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


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


# --- the proof: is this process the recorded command's, inside this sandbox, right now? ----------------


class _Look:
    """/proc read anew on every question: how a process is proven right before its signal."""

    def __init__(self, proc: Path, sandbox: tuple[int, int]) -> None:
        self.proc = proc
        self.sandbox = sandbox  # (st_dev, st_ino) of the sandbox directory, held open by the reaper

    def stat(self, pid: int) -> ProcStat | None:
        return records.proc_stat(self.proc, pid)

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
        self._stats: dict[int, ProcStat] = {}  # live processes only: bounded by the node's, not by the records
        self._inside: dict[int, bool] = {}
        # The pids alive before any record is read: a recorded process started before its record was
        # written, so one not listed is gone (262,144 forged dead pids cost a set lookup each, not a read).
        self.listed = frozenset(int(e.name) for e in os.scandir(proc) if e.name.isdigit())

    def stat(self, pid: int) -> ProcStat | None:
        s = self._stats.get(pid)
        if s is None:
            s = records.proc_stat(self.proc, pid)
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
    own: ProcStat | None  # the reaper's own /proc stat: its group and session are never signalled


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


def _descends(scope: _Scope, s: ProcStat, look: _Look) -> bool:
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
            s = records.proc_stat(proc, int(entry.name))
            if s is not None and s.sid in sessions:
                found.setdefault(s.sid, []).append(Mark(int(entry.name), s.start))
    return found


@dataclass
class _Judged:
    """One record, judged: what to signal (proven, with the scope to prove it again), and what holds."""

    record: Record
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
    boot = records.boot_id(proc)
    names, over = records.record_names(cfd)
    if over is not None:
        plan.refused.append(over)
    kept: list[Record] = []
    for name in names:
        if records.recorder_alive(cfd, name):
            continue
        raw = records.read_record(cfd, name)
        parsed = raw if not isinstance(raw, bytes) else records.parse_record(name, raw)
        if isinstance(parsed, Refusal):
            plan.refused.append(parsed)
        elif isinstance(parsed, Record) and boot is not None and parsed.boot == boot:
            kept.append(parsed.alive(look.same))  # the dead forgotten at once: memory follows live processes
        elif raw is not None:
            plan.dropped.append(name)
    own = records.proc_stat(proc, os.getpid())
    live = {r.name: [m for m in r.marks() if look.same(m)] for r in kept}
    scopes = {
        r.name: _Scope(r.session, r.leader.start if r.leader else 0, own)
        for r in kept
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
    for r in kept:
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
    with records.commands_dir(sandbox_dir, create=False) as found:
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
    with records.commands_dir(sandbox_dir, create=False) as found:
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
            return _GONE if err.errno == E.ESRCH else f"pidfd_open failed ({records.errname(err)})"
        why = _verdict(scope, mark, fresh)
        return Handle(mark.pid, None) if why is None else why
    why = _verdict(scope, mark, fresh)
    if why is None:
        return Handle(mark.pid, fd)
    os.close(fd)
    return why


def _reap(plan: _Plan, cfd: int, timeout: float, kill: Kill, proc: Path) -> ReapResult:
    for name in plan.dropped:
        records.remove_record(cfd, name)
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
        return [m for m in tried if records.is_alive(proc, m)]

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.02)

    survivors: dict[Mark, Survivor] = {}
    why = {m: w for j in plan.judged for m, w in j.unproven if m not in killed}  # never signalled: why not
    for j in plan.judged:
        live = [m for m in dict.fromkeys([*j.record.marks(), *j.proven]) if records.is_alive(proc, m)]
        if not live:
            records.remove_record(cfd, j.record.name)
            continue
        for m in live:
            survivors.setdefault(m, Survivor(m.pid, records.command_line(proc, m.pid), why.get(m)))
        leader = j.record.leader
        members = [m for m in live if m != leader][: records.MAX_MEMBERS]  # unrecorded survivors join, within the cap
        if j.record.pruned or set(members) != set(j.record.members):  # an unchanged record is not rewritten
            records.write_record(cfd, j.record.name, records.record_body(j.record.boot, leader, members))
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
