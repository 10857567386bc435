"""`sandkeep retain | pin | ls | sweep` as a person runs them: real processes, real exit codes, real output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from diskkit import REPO, User, listing, make_job

from controller.inuse import uninspectable_pids

pytest_plugins = ["diskkit"]  # fixtures: throwaway_user

IGNORE = [f"--ignore-pid={pid}" for pid in sorted(uninspectable_pids())]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "SANDKEEP_LOG_LEVEL": "INFO"}


def sandkeep(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, env=ENV, timeout=60
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "controller.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float = 30) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if needle in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{needle!r} never appeared (exit {proc.poll()})")


def test_retain_pin_ls_and_sweep_from_the_command_line(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for name, created in (("fresh", None), ("old", "2020-01-01T00:00:00Z"), ("kept", "2020-01-01T00:00:00Z")):
        job = make_job(tmp_path, name)
        args = ["retain", str(job), "--root", root, "--namespace", "team-a", "--name", name, "--exclude", "session"]
        out = sandkeep(*args, *(["--created-at", created] if created else []), "--retention", "72h", check=True)
        assert out.stdout.startswith(f"retained team-a/{name} (job {name}) until ")
    pinned = sandkeep("pin", "team-a/kept", "--root", root, "--for", "2h", check=True)
    assert pinned.stdout.startswith("pinned team-a/kept until ")
    table = sandkeep("ls", "--root", root, check=True).stdout.splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "DEADLINE", "SOURCE", "LEFT", "STATE", "SIZE"]
    states = {row.split()[1]: row.split()[5] for row in table[1:]}
    assert states == {"fresh": "Retained", "old": "Expired", "kept": "Pinned"}
    swept = sandkeep("sweep", "--root", root, "--once", *IGNORE, check=True)
    assert "sweep_deleted reason=Window entry=team-a/old" in swept.stderr
    after = json.loads(sandkeep("ls", "--root", root, "-o", "json", check=True).stdout)
    assert sorted(s["name"] for s in after["sandboxes"]) == ["fresh", "kept"]
    assert after["tombstones"] == [] and after["strays"] == []
    assert not (Path(root) / "team-a" / "fresh" / "workspace" / "session").exists()
    assert sandkeep("pin", "team-a/kept", "--root", root, "--clear", check=True).stdout == "unpinned team-a/kept\n"


def test_a_pin_beyond_max_pin_says_it_is_capped(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    sandkeep("retain", str(make_job(tmp_path)), "--root", root, "--namespace", "ns", "--name", "r", check=True)
    out = sandkeep("pin", "ns/r", "--root", root, "--for", "60d", "--max-pin", "7d", check=True)
    assert "capped by the maximum pin (7d0h)" in out.stdout or "capped by the maximum pin (7d)" in out.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["sweep", "--root", "{root}", "--retention", "3x"], "'3x': not a duration"),
        (["sweep", "--root", "{root}", "--interval", "soon"], "'soon': not a duration"),
        (["pin", "bad-ref", "--root", "{root}", "--for", "1h"], "expected NAMESPACE/NAME"),
        (["pin", "ns/r", "--root", "{root}", "--until", "tomorrow"], "not an RFC 3339 time"),
        (["pin", "ns/r", "--root", "{root}", "--until", "2001-01-01T00:00:00Z"], "is not in the future"),
        (["pin", "ns/r", "--root", "{root}"], "one of the arguments --for --until --clear is required"),
        (["ls"], "--root is required"),
        (["retain", "{job}", "--root", "{root}", "--namespace", "Bad_NS", "--name", "r"], "not a DNS-1123 label"),
        (["retain", "{job}", "--root", "{root}", "--namespace", "ns", "--name", "r", "--created-at", "x"], "RFC 3339"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    job = make_job(tmp_path)
    env_root = os.environ.pop("SANDKEEP_ROOT", None)
    try:
        out = sandkeep(*[a.format(root=tmp_path / "root", job=job) for a in args])
    finally:
        if env_root is not None:
            os.environ["SANDKEEP_ROOT"] = env_root
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr


def test_what_cannot_be_done_is_exit_1_with_the_reason(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    missing = sandkeep("retain", str(tmp_path / "nope"), "--root", root, "--namespace", "ns", "--name", "r")
    assert missing.returncode == 1 and "No such file or directory" in missing.stderr
    absent = sandkeep("pin", "ns/never", "--root", root, "--for", "1h")
    assert absent.returncode == 1 and "cannot pin it" in absent.stderr
    assert "Traceback" not in missing.stderr + absent.stderr


def test_two_sweeps_on_one_root_the_second_exits_or_waits(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    first = start("sweep", "--root", root, "--interval", "1h", *IGNORE)
    waiter: subprocess.Popen[str] | None = None
    try:
        wait_for_line(first, "sweep_pass")
        second = sandkeep("sweep", "--root", root, "--once")
        assert second.returncode == 3
        assert f"process {first.pid} holds .sandkeep.lock" in second.stderr and "Traceback" not in second.stderr
        waiter = start("sweep", "--root", root, "--once", "--wait", "30", *IGNORE)
        time.sleep(0.5)
        assert waiter.poll() is None  # still waiting for the lock
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        assert waiter.wait(timeout=30) == 0
        assert waiter.stderr is not None and "sweep_pass" in waiter.stderr.read()
    finally:
        for proc in (first, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.root
def test_a_root_owned_by_another_uid_is_refused_by_every_command(tmp_path: Path, throwaway_user: User) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chown(root, throwaway_user.uid, throwaway_user.gid)
    job = str(make_job(tmp_path))
    for args in (
        ["sweep", "--root", str(root)],
        ["ls", "--root", str(root)],
        ["retain", job, "--root", str(root), "--namespace", "n", "--name", "r"],
    ):
        out = sandkeep(*args)
        assert out.returncode == 3, out.stderr
        assert f"owned by uid {throwaway_user.uid}" in out.stderr and "Traceback" not in out.stderr
    assert listing(root) == []


def test_ls_names_tombstones_stuck_ones_and_strays(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandkeep("retain", str(make_job(tmp_path)), "--root", str(root), "--namespace", "ns", "--name", "r", check=True)
    old_ms = int((time.time() - 3600) * 1000)
    (root / f".reap-p1-abcd1234-{old_ms}").mkdir()
    (root / f".reap-0f1e2d3c-4b5a-{int(time.time() * 1000)}").mkdir()
    (root / "ns" / "link").symlink_to("/etc")
    out = sandkeep("ls", "--root", str(root), check=True).stdout
    (stuck_line,) = [line for line in out.splitlines() if f".reap-p1-abcd1234-{old_ms}" in line]
    assert stuck_line.startswith("tombstone ") and " age 1h" in stuck_line and stuck_line.endswith("STUCK")
    assert "tombstone .reap-0f1e2d3c-4b5a-" in out and out.count("STUCK") == 1
    assert "not a sandbox: ns/link (Symlink)" in out
    data = json.loads(sandkeep("ls", "--root", str(root), "-o", "json", check=True).stdout)
    assert [t["stuck"] for t in data["tombstones"]] == [True, False]
    assert data["sandboxes"][0]["state"] == "Retained" and data["sandboxes"][0]["size"] > 0
