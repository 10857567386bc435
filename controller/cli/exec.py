"""`sandkeep exec`: run a command in a sandbox's workspace, recording its processes (node/orphan_records.py).

The command is started as the leader of a session of its own (setsid) and walked while it runs; its
processes are recorded as `node/orphan_records.py` describes, so that what a killed `sandkeep exec` left
can be reaped (`node/orphans.py`) before the sandbox is deleted or opened again.

`sandkeep exec` starts nothing in a sandbox the opener's rule refuses (`opener.refusal`: expired by the
sweep's own rule with `ls`'s policy flags, being deleted, stuck, lost, unreadable) or that recorded
orphans still hold: one paragraph on stderr and EXIT_REFUSED. After launch it asks the rule again, with
the workspace it started the command in (`_PostLaunch`), and stops the command's session on a refusal.
A sandbox retained for a cluster node is judged on its manifest, as `ls` judges it (see opener.py).
Exit codes: the command's own, EXIT_REFUSED (76), EXIT_USAGE (2), 127 when the command cannot start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno as E
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.cli.standalone import SweepSettings
from controller.cli.sweep import utcnow
from controller.node.nofollow import OPEN_DIR
from controller.node.opener import Opening, refusal
from controller.node.orphan_records import Mark, Recorder, boot_id, is_alive, open_commands_dir, proc_stat
from controller.node.orphans import Kill, held_message, reap_orphans, send
from controller.node.store import Present, Read, Root, StoreError
from controller.node.store import Refusal as StoreRefusal
from controller.observe import logs
from controller.rules.contracts import WORKSPACE_DIR, Reason
from controller.rules.durations import Invalid, parse_duration
from controller.rules.flags import settings_from

log = logging.getLogger("sandkeep.commands")

EXIT_REFUSED = 76  # the opener refused the sandbox (expired, being deleted, stuck, lost, orphans): see run()
EXIT_USAGE = 2
WALK_EVERY = 0.1  # seconds between walks of the command's tree while it runs
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
EXEC_KILL: list[Kill] = [send]  # how `sandkeep exec` signals orphans; a test swaps it to make a survivor

# --- `sandkeep exec` -----------------------------------------------------------------------------------

# The exec's policy flags: the standalone `ls` and `sweep`'s own (same names, same defaults, same env), so
# the two agree on what is expired.
_POLICY_FLAGS = ("retention", "retention_failed", "retention_succeeded", "retention_unknown", "max_pin", "stuck_after")


def _options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    parser.add_argument("--root", type=Path, default=None, help="the node's sandbox root (required)")
    parser.add_argument(
        "--orphan-timeout",
        default=None if not top else "10s",
        help="how long to wait for a killed orphan (or a refused command) to end (default 10s)",
    )
    parser.add_argument("--retention", default=None, help="the window, as `sandkeep ls` takes it (default 72h)")
    for outcome in ("failed", "succeeded", "unknown"):
        parser.add_argument(f"--retention-{outcome}", default=None, help=f"the window of {outcome} jobs, as `ls`")
    parser.add_argument("--max-pin", default=None, help="the longest pin honoured, as `sandkeep ls` (30d)")
    parser.add_argument("--stuck-after", default=None, help="a tombstone this old is stuck, as `sandkeep ls` (10m)")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    # argparse cannot take `--` inside a subcommand, so everything after the subcommand is taken whole and
    # split here: NAMESPACE/NAME and options before `--`, the command after it.
    _options(parser, top=True)
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar="NAMESPACE/NAME [--root DIR] -- CMD...", help="sandbox and command"
    )


@dataclass(frozen=True)
class _Exec:
    sandbox: str
    root: Path | None
    orphan_timeout: str
    policy: dict[str, str]  # the policy flags given (by their settings names)
    argv: list[str]


def _split(args: argparse.Namespace) -> _Exec | None:
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
    given = {k: getattr(ns, k) or getattr(args, k, None) for k in _POLICY_FLAGS}
    policy = {k: v for k, v in given.items() if v is not None}
    return _Exec(ns.sandbox, root, ns.orphan_timeout or args.orphan_timeout, policy, argv)


def run(command: str, args: argparse.Namespace) -> int:
    """`sandkeep exec`: refused (EXIT_REFUSED, nothing started) when the opener's rule says so, else run."""

    split = _split(args)
    usage = (
        "sandkeep exec: usage: sandkeep exec NAMESPACE/NAME --root DIR [--orphan-timeout 10s] [--retention 72h] "
        "[--max-pin 30d] [--stuck-after 10m] -- CMD..."
    )
    if split is None:
        _err(usage)
        return EXIT_USAGE
    timeout = parse_duration(split.orphan_timeout)
    ns, _, name = split.sandbox.partition("/")
    if not split.argv or not name or split.root is None or isinstance(timeout, Invalid):
        _err(usage)
        return EXIT_USAGE
    try:
        settings = settings_from(SweepSettings, argparse.Namespace(**split.policy))
    except ValueError as err:
        _err(f"sandkeep exec: error: bad policy flag or SANDKEEP_* setting: {str(err).splitlines()[0]}")
        return EXIT_USAGE
    try:
        root = Root(split.root, create=False)
        sandbox = root.sandbox_path(ns, name)
        read = root.read(ns, name)
    except (StoreError, ValueError) as err:
        _err(f"sandkeep exec: {err}")
        return EXIT_USAGE
    ref, policy = f"{ns}/{name}", settings.policy()

    def judge(held: tuple[int, int] | None = None) -> StoreRefusal | None:
        """The opener's rule on what is on disk now; after launch, with the workspace the command is in.

        A manifest read just before a sweep renamed the sandbox away, and then no workspace at its path, is a
        look that straddled the rename: it is read again, so the sweep is told as what it was (`Tombstoned`),
        not as a replacement."""
        fresh, found = read, None
        if held is not None:
            fresh, found = _look(root, ns, name)
            if found is None and isinstance(fresh, Present):
                fresh, found = _look(root, ns, name)
        opening = _opening(root, ref, fresh, held, found)
        return refusal(opening, policy, utcnow(), stuck_after=settings.stuck_after)

    refused = judge()
    if refused is not None:
        _refused(ref, refused)
        return EXIT_REFUSED
    assert isinstance(read, Present)  # the rule refuses every read that is not a manifest
    reaped = reap_orphans(sandbox, timeout=timeout.total_seconds(), kill=EXEC_KILL[0])
    if reaped.signalled:
        logs.say(log, "orphans_reaped", reason=Reason.ORPHAN_REAPED, sandbox=ref, signalled=reaped.signalled)
    if reaped.hold is not None:
        where = f"sandkeep exec: sandbox {ref}: refused to start ({reaped.hold})"
        _err(held_message(where, reaped, timeout.total_seconds()))
        return EXIT_REFUSED
    launch = _Launch(root.path, [ns, name, *_parts(read)], ref, judge, timeout.total_seconds())
    return _run_recorded(sandbox, launch, split.argv)


def _parts(read: Read) -> list[str]:
    """The workspace's path below the sandbox, by components (the manifest says which; `workspace` without one)."""
    from controller.node.store import Mismatch, Present

    workspace = read.manifest.workspace if isinstance(read, Present | Mismatch) else WORKSPACE_DIR
    return [p for p in workspace.split("/") if p not in ("", ".")]


def _opening(root: Root, ref: str, read: Read, held: tuple[int, int] | None, found: tuple[int, int] | None) -> Opening:
    """What the rule reads: with the root's tombstones and their manifests when the name holds none."""
    from controller.node.opener import Opening, Remains
    from controller.node.store import Mismatch, Present

    remains: list[Remains] = []
    if not isinstance(read, Present | Mismatch):
        with contextlib.suppress(OSError):
            remains = [Remains(t, root.read_tombstone(t)) for t in root.tombstones()]
    return Opening(ref, str(root.path), read, remains, held, found)


def _refused(ref: str, refused: StoreRefusal) -> None:
    """One paragraph for a person: the sandbox, what was refused and why (its reason code), what to do."""
    _err(f"sandkeep exec: sandbox {ref}: refused to start ({refused.reason}): {refused.why}. {refused.next}.")


@dataclass(frozen=True)
class _Launch:
    """Where a command is started (components below `root`, each opened without following a link) and
    the opener's rule to ask again after launch with the identity of the workspace it was started in."""

    root: Path
    parts: list[str]
    label: str
    judge: Callable[[tuple[int, int]], StoreRefusal | None]
    timeout: float  # how long a refused command may take to end after SIGTERM, before SIGKILL


# Test seams: called right after the command started, before the post-launch look (a sweep landing then).
AFTER_LAUNCH: list[Callable[[], None]] = []
LOOK_FOR = 2.0  # seconds after launch the look is repeated on every walk: a sweep that passed its in-use
# check before the command existed renames within milliseconds; later, the running command holds it.


def _open_workspace(root: Path, parts: list[str]) -> int:
    """The workspace directory as an fd, from the root down, every component opened without following a
    link; `..` is refused, so it never leaves the root."""
    fd = os.open(root, OPEN_DIR)
    try:
        for part in parts:
            if part == "..":
                raise OSError(E.EACCES, "a workspace path may not climb out of its sandbox")
            nxt = os.open(part, OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _look(root: Root, ns: str, name: str) -> tuple[Read, tuple[int, int] | None]:
    """The sandbox's manifest now, and the identity of the workspace it names at its path now."""
    fresh = root.read(ns, name)
    return fresh, _identity(root.path, [ns, name, *_parts(fresh)])


def _identity(root: Path, parts: list[str]) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the directory at `parts` below `root` now, or None when it cannot be opened."""
    try:
        fd = _open_workspace(root, parts)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


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


def _run_recorded(sandbox: Path, launch: _Launch, argv: list[str]) -> int:
    boot = boot_id()
    _become_subreaper()
    label, workspace = launch.label, "/".join(launch.parts[2:])
    try:
        wfd = _open_workspace(launch.root, launch.parts)
        st = os.fstat(wfd)
    except OSError as err:
        _err(
            f"sandkeep exec: sandbox {label}: cannot enter its workspace {workspace!r} ({os.strerror(err.errno or 0)})"
        )
        return EXIT_USAGE
    held = (st.st_dev, st.st_ino)
    with contextlib.ExitStack() as stack:
        stack.callback(os.close, wfd)
        cfd = stack.enter_context(open_commands_dir(sandbox, create=True))
        try:
            # chdir through the held fd: a workspace swapped for a link after the checks is never entered
            child = subprocess.Popen(argv, cwd=f"/proc/self/fd/{wfd}", pass_fds=(wfd,), start_new_session=True)
        except OSError as err:
            _err(f"sandkeep exec: {argv[0]}: {os.strerror(err.errno or 0)}")
            return 127
        leader_stat = proc_stat(Path("/proc"), child.pid)
        recorder = None
        if cfd is not None and boot is not None and leader_stat is not None:
            recorder = Recorder(cfd, Mark(child.pid, leader_stat.start), boot, subreaper=True)
        elif cfd is None:
            logs.say(log, "commands_unrecorded", level=logging.WARNING, reason=Reason.IN_USE_UNKNOWN, sandbox=label)
        previous = {sig: signal.signal(sig, _forward(child)) for sig in _FORWARDED}
        try:
            for hook in AFTER_LAUNCH:
                hook()
            look = _PostLaunch(launch, held, time.monotonic())
            code = _wait_recording(child, recorder, look)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if recorder is not None:
                recorder.finish()
    return code if code >= 0 else 128 - code


@dataclass
class _PostLaunch:
    """The post-launch look: right after launch and on every walk for LOOK_FOR seconds, the opener's rule
    asked again with the workspace the command was started in; a refusal ends the command's session."""

    launch: _Launch
    held: tuple[int, int]
    since: float

    def refused(self) -> StoreRefusal | None:
        if time.monotonic() - self.since > LOOK_FOR:
            return None
        return self.launch.judge(self.held)


def _stop_session(child: subprocess.Popen[bytes], recorder: Recorder | None, timeout: float) -> None:
    """SIGTERM the command's group and every recorded live member, SIGKILL what is left after `timeout`.

    The group through its leader's pid (our child, not reaped yet, so never reused); a member through a
    pidfd opened and checked to be still the recorded process, so never a recycled pid."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, sig)
        members = [m for m in recorder.members.values() if is_alive(recorder.proc, m)] if recorder else []
        for m in members:
            _signal_mark(recorder.proc if recorder else Path("/proc"), m, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap_adopted(child.pid)
            if child.poll() is not None and not any(is_alive(Path("/proc"), m) for m in members):
                return
            time.sleep(0.02)


def _signal_mark(proc: Path, mark: Mark, sig: int) -> None:
    try:
        fd = os.pidfd_open(mark.pid)
    except OSError:
        return
    try:
        if is_alive(proc, mark):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def _forward(child: subprocess.Popen[bytes]) -> Callable[[int, Any], None]:
    def handler(signum: int, _frame: Any) -> None:
        # Our child is not reaped until we wait, so its pid (and group) cannot have been reused.
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

    return handler


def _wait_recording(child: subprocess.Popen[bytes], recorder: Recorder | None, look: _PostLaunch | None = None) -> int:
    """Walk the command's processes every WALK_EVERY until it exits. A record that cannot be written is
    said once (until a write works again) and written again on the next walk, as the reference does.
    With `look`, the post-launch look runs before each walk while it lasts; a refusal stops the session
    and returns EXIT_REFUSED."""
    failing = False
    while True:
        refused = look.refused() if look is not None else None
        if refused is not None and look is not None:
            logs.say(log, "exec_stopped", level=logging.WARNING, reason=refused.reason, sandbox=look.launch.label)
            _stop_session(child, recorder, look.launch.timeout)
            _err(
                f"sandkeep exec: sandbox {look.launch.label}: the command was stopped right after it started "
                f"({refused.reason}): {refused.why}. {refused.next}."
            )
            return EXIT_REFUSED
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
