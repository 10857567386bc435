"""`sandkeep exec` refuses what the opener's rule refuses, and looks again after launch.

Real roots, real tombstones, real processes: every refusal exits EXIT_REFUSED with nothing started (a
marker the command would touch stays absent), names the sandbox and the reason code; `ls` with the same
flags calls the same sandbox Expired. The post-launch look is driven through a small driver process that
adds a hook to `sandkeep_exec.AFTER_LAUNCH`: it sweeps the sandbox (and retains another of the same name)
while the real command runs, and `sandkeep exec` ends that command's session with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.cli.exec import EXIT_REFUSED
from controller.node.store import Root, standalone_id
from tests.bed.procs import alive

REPO = Path(__file__).resolve().parents[2]
SANDKEEP = [sys.executable, "-m", "controller.cli.sandkeep"]


def _retain(root: Root, tmp: Path, *, created: timedelta, retention: timedelta | None, name: str = "box") -> Path:
    """A sandbox `ns/<name>` created `created` ago, with `retention` recorded (None: no retainUntil)."""
    src = tmp / f"job-{name}-{len(list(tmp.iterdir()))}"
    src.mkdir()
    (src / "data.txt").write_text("payload")
    root.retain(src, "ns", name, job_id="j1", created_at=datetime.now(UTC) - created, retention=retention)
    return root.path / "ns" / name


def _sandkeep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SANDKEEP, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _exec(root: Root, *flags: str, marker: Path) -> subprocess.CompletedProcess[str]:
    return _sandkeep("exec", "ns/box", "--root", str(root.path), *flags, "--", "touch", str(marker))


def _refused(out: subprocess.CompletedProcess[str], reason: str, marker: Path) -> str:
    assert out.returncode == EXIT_REFUSED, out.stderr
    assert not marker.exists(), "the command ran"
    err = out.stderr
    assert f"sandkeep exec: sandbox ns/box: refused to start ({reason}):" in err, err
    assert len(err.strip().splitlines()) == 1, "one paragraph"
    return err


def _ls_state(root: Root, *flags: str) -> str:
    out = _sandkeep("ls", "--root", str(root.path), "-o", "json", *flags)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["sandboxes"]
    return str(row["state"])


@pytest.fixture
def root(tmp_path: Path) -> Root:
    (tmp_path / "jobs").mkdir()
    return Root(tmp_path / "root")


def test_exec_refuses_a_sandbox_the_window_expired_exactly_as_ls_calls_it(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(hours=2), retention=None)
    marker = tmp_path / "ran"

    err = _refused(_exec(root, "--retention", "1h", marker=marker), "Expired", marker)
    assert "Window" in err and "sandkeep pin ns/box" in err and "copy out what you need" in err
    assert _ls_state(root, "--retention", "1h") == "Expired"

    assert _exec(root, marker=marker).returncode == 0  # the default window (72h), as `ls` keeps it
    assert marker.exists() and _ls_state(root) == "Retained"


def test_exec_refuses_a_sandbox_past_its_retain_until_whatever_its_own_window(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(hours=2), retention=timedelta(hours=1))
    marker = tmp_path / "ran"

    err = _refused(_exec(root, "--retention", "30d", marker=marker), "Expired", marker)
    assert "RetainUntil" in err
    assert _ls_state(root, "--retention", "30d") == "Expired"


def test_a_pin_that_extends_the_deadline_keeps_exec_allowed(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(hours=2), retention=timedelta(hours=1))
    marker = tmp_path / "ran"
    _refused(_exec(root, marker=marker), "Expired", marker)

    root.pin("ns", "box", datetime.now(UTC) + timedelta(hours=1), now=datetime.now(UTC))
    out = _exec(root, marker=marker)
    assert out.returncode == 0, out.stderr
    assert marker.exists() and _ls_state(root) == "Pinned"


def test_exec_refuses_a_sandbox_being_deleted_naming_its_tombstone(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(minutes=1), retention=timedelta(hours=1))
    tomb = root.tombstone("ns", "box", id=standalone_id(), now=datetime.now(UTC))
    marker = tmp_path / "ran"

    err = _refused(_exec(root, marker=marker), "Tombstoned", marker)
    assert str(tomb.path) in err and "being deleted" in err


def test_exec_refuses_a_sandbox_whose_tombstone_is_stuck_by_the_stuck_after_ls_uses(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(minutes=1), retention=timedelta(hours=1))
    tomb = root.tombstone("ns", "box", id=standalone_id(), now=datetime.now(UTC) - timedelta(hours=1))
    marker = tmp_path / "ran"

    err = _refused(_exec(root, marker=marker), "TombstoneStuck", marker)
    assert str(tomb.path) in err and "stuck" in err
    _refused(_exec(root, "--stuck-after", "2h", marker=marker), "Tombstoned", marker)


def test_exec_refuses_a_tombstone_holding_a_live_pin_until_the_sweep_puts_it_back(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(minutes=1), retention=timedelta(hours=1))
    root.pin("ns", "box", datetime.now(UTC) + timedelta(hours=5), now=datetime.now(UTC))
    root.tombstone("ns", "box", id=standalone_id(), now=datetime.now(UTC))  # a pin landed mid-sweep
    marker = tmp_path / "ran"

    err = _refused(_exec(root, marker=marker), "TombstonePinned", marker)
    assert "puts it back" in err


def test_exec_refuses_an_absent_sandbox_with_the_refusal_exit_code(root, tmp_path):
    marker = tmp_path / "ran"
    _refused(_exec(root, marker=marker), "ManifestAbsent", marker)


def test_a_tombstone_of_another_sandbox_or_a_retains_stage_is_not_this_ones_deletion(root, tmp_path):
    _retain(root, tmp_path / "jobs", created=timedelta(minutes=1), retention=timedelta(hours=1), name="other")
    root.tombstone("ns", "other", id=standalone_id(), now=datetime.now(UTC) - timedelta(hours=1))
    marker = tmp_path / "ran"
    _refused(_exec(root, marker=marker), "ManifestAbsent", marker)


# --- the post-launch look ------------------------------------------------------------------------------

_DRIVER = textwrap.dedent(
    """
    import ctypes, os, sys, threading, time
    from datetime import UTC, datetime
    from pathlib import Path
    from controller.cli import sandkeep
    from controller.cli import exec as sandkeep_exec
    from controller.node.store import Root, standalone_id, tombstone_name

    root_dir, other, ready, when = sys.argv[1:5]

    def sweep():
        # what a sweep that passed its in-use check before the command existed does, once it runs; with a
        # replacement, the swap is one renameat2(RENAME_EXCHANGE), so no look can fall between its two halves
        deadline = time.monotonic() + 30
        while not Path(ready).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not other:
            Root(root_dir, create=False).tombstone("ns", "box", id=standalone_id(), now=datetime.now(UTC))
            return
        mine, theirs = f"{root_dir}/ns/box".encode(), f"{other}/ns/box".encode()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.renameat2(-100, mine, -100, theirs, 2) == 0, os.strerror(ctypes.get_errno())
        os.rename(theirs, f"{root_dir}/{tombstone_name(standalone_id(), datetime.now(UTC))}")

    if when == "at-launch":
        sandkeep_exec.AFTER_LAUNCH.append(sweep)
    elif when == "between-reads":  # the sweep lands between a look's manifest read and its workspace's open
        armed, real = [], sandkeep_exec._identity

        def identity(*args):
            if armed:
                armed.clear()
                sweep()
            return real(*args)

        sandkeep_exec._identity = identity
        sandkeep_exec.AFTER_LAUNCH.append(lambda: armed.append(True))
    else:  # during the walks: the look must repeat after the first one found nothing
        sandkeep_exec.LOOK_FOR = 60.0  # the swap comes as soon as the command runs; a loaded machine is slow
        sandkeep_exec.AFTER_LAUNCH.append(lambda: threading.Thread(target=sweep, daemon=True).start())
    sys.exit(sandkeep.main(sys.argv[5:]))
    """
)


@pytest.mark.parametrize(
    ("when", "replaced", "trap", "reason", "ended_by"),
    [
        ("at-launch", True, 'echo TERM > "$OUT"; exit 143', "Replaced", "TERM"),
        ("during-walks", False, 'echo TERM > "$OUT"; exit 143', "Tombstoned", "TERM"),
        ("between-reads", False, 'echo TERM > "$OUT"; exit 143', "Tombstoned", "TERM"),  # told as what it was
        ("during-walks", True, "", "Replaced", "KILL"),  # SIGTERM ignored: SIGKILL after --orphan-timeout
    ],
)
def test_a_sandbox_swept_while_its_command_starts_ends_the_command_with_the_reason(
    root, tmp_path, pids, when, replaced, trap, reason, ended_by
):
    _retain(root, tmp_path / "jobs", created=timedelta(minutes=1), retention=timedelta(hours=1))
    other = ""
    if replaced:  # the replacement, retained under the same name (in a root beside it) before the swap
        other_src = tmp_path / "jobs" / "replacement"
        other_src.mkdir()
        (other_src / "new.txt").write_text("the new one")
        beside = Root(tmp_path / "beside")
        beside.retain(other_src, "ns", "box", job_id="j2", created_at=datetime.now(UTC), retention=None)
        other = str(beside.path)
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    ready, out = tmp_path / "ready", tmp_path / "out"
    script = f"trap '{trap}' TERM; echo $$ > \"$READY\"; while :; do sleep 0.05; done"
    argv = ["exec", "ns/box", "--root", str(root.path), "--orphan-timeout", "1s", "--", "sh", "-c", script]
    env = {**os.environ, "READY": str(ready), "OUT": str(out)}
    started = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, str(driver), str(root.path), other, str(ready), when, *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:  # the command is a session of its own: cleaned up by pid even when exec never ended it
        if ready.exists() and ready.read_text().strip().isdigit():
            pids.append(int(ready.read_text()))
    leader = int(ready.read_text())

    assert p.returncode == EXIT_REFUSED, p.stdout + p.stderr
    assert f"sandkeep exec: sandbox ns/box: the command was stopped right after it started ({reason}):" in p.stderr
    assert not alive(leader)
    assert time.monotonic() - started < 60  # ended by the look, not by the loop running out
    assert (out.read_text().strip() if out.exists() else "KILL") == ended_by
    if replaced:  # the new sandbox is left as it was, and is opened by the next exec
        assert (root.path / "ns" / "box" / "workspace" / "new.txt").read_text() == "the new one"
        again = _sandkeep("exec", "ns/box", "--root", str(root.path), "--", "cat", "new.txt")
        assert again.returncode == 0 and again.stdout == "the new one", again.stderr
