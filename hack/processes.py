"""The processes a local bed starts (the control plane, a registry, Prometheus, a node's daemons): each the
leader of its own process group, stopped by pid, killed with its launcher; free loopback ports; and the
signals that turn into an exception so that a `with` block stops them all."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port that is free on 127.0.0.1 right now (the start retries if another process takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the launching thread dies (SIGKILL of pytest, a crash)
    # the kernel sends the component SIGKILL, so no etcd or apiserver outlives a killed test run.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log yet)"
    return "\n".join(data.splitlines()[-lines:])


def spawn(name: str, command: list[str], log: Path, cwd: Path | None = None) -> Component:
    """Start `command` as the leader of its own process group (so it is stopped by pid, with everything it
    forks), output appended to `log`, killed with its launcher when that is the main thread."""
    log_file = log.open("ab")
    preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
        cwd=cwd,
    )
    return Component(name, proc, log, log_file)


def stop_group(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    """Send `sig` to the process group `proc` leads, wait, then SIGKILL the group. Only while the leader is
    unreaped: once waited for, the pid could be reused by an unrelated process."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)


@dataclass
class Component:
    """One process the cluster started: its name, Popen handle and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group this component leads, wait, then SIGKILL it.

        Only a group we created (start_new_session=True makes pgid == pid) and only while the leader is
        unreaped: once waited for, the pid could be reused by an unrelated process.
        """
        stop_group(self.proc, signal.SIGTERM, timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class Lifecycle:
    """`with X(...) as x:` starts it and stops it, also on an error, which marks it failed (a failed one's
    files may be kept for a look: SANDKEEP_KEEP_CLUSTER_DIR)."""

    failed = False

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.failed = True
        self.stop()


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn the first SIGINT, SIGTERM or SIGHUP into an exception, so `with LocalCluster()` stops everything.

    SIGINT is set explicitly because a shell starts background jobs with it ignored. Later signals are
    ignored: a second Ctrl-C while the components are being stopped must not leave one of them running.
    """
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def handler(signum: int, _frame: object) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
