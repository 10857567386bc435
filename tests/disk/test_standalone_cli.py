"""`sandkeep retain | pin | ls | sweep` as a person runs them: real processes, real exit codes, real output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.cli.standalone import Replacer
from controller.cli.sweep import in_use_checker
from controller.node.inuse import uninspectable_pids
from controller.node.reaper import Reaper
from controller.node.store import Root, StoreError
from controller.rules.contracts import Reason
from controller.rules.models import Manifest
from tests.bed.diskkit import REPO, User, bind_mount, listing, make_job

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: throwaway_user, mounts

IGNORE = [f"--ignore-pid={pid}" for pid in sorted(uninspectable_pids())]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "SANDKEEP_LOG_LEVEL": "INFO"}


def sandkeep(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli.sandkeep", *args], capture_output=True, text=True, env=ENV, timeout=60
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "controller.cli.sandkeep", *args],
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


def test_retain_records_the_outcome_and_ls_and_sweep_keep_each_outcome_for_its_own_window(tmp_path: Path) -> None:
    # Issue 28: a failure kept 14 days, a success 1 hour, a job that stated no outcome the plain 72h window.
    root = str(tmp_path / "root")
    created = (datetime.now(UTC) - timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name, outcome in (("broke", ["--outcome", "Failed"]), ("fine", ["--outcome", "Succeeded"]), ("plain", [])):
        args = ["retain", str(make_job(tmp_path, name)), "--root", root, "--namespace", "ci", "--name", name]
        sandkeep(*args, "--created-at", created, *outcome, check=True)
    origin = Manifest.model_validate_json((Path(root) / "ci" / "broke" / "manifest.json").read_text()).origin
    assert origin is not None and origin.body() == {"outcome": "Failed", "podUID": "", "containers": [], "labels": {}}
    assert "origin" not in json.loads((Path(root) / "ci" / "plain" / "manifest.json").read_text())
    windows = ["--retention-failed", "14d", "--retention-succeeded", "1h"]
    table = sandkeep("ls", "--root", root, *windows, check=True).stdout.splitlines()
    states = {row.split()[1]: row.split()[5] for row in table[1:]}
    assert states == {"broke": "Retained", "fine": "Expired", "plain": "Retained"}
    swept = sandkeep("sweep", "--root", root, "--once", *windows, *IGNORE, check=True)
    assert "sweep_deleted reason=Window entry=ci/fine" in swept.stderr
    left = json.loads(sandkeep("ls", "--root", root, "-o", "json", check=True).stdout)
    assert sorted(s["name"] for s in left["sandboxes"]) == ["broke", "plain"]
    bad = sandkeep(
        "retain", str(make_job(tmp_path, "x")), "--root", root, "--namespace", "ci", "--name", "x", "--outcome", "Meh"
    )
    assert bad.returncode == 2 and "invalid choice: 'Meh'" in bad.stderr


def test_the_sweep_applies_the_history_limits_by_the_labels_retain_records(tmp_path: Path) -> None:
    # Issue 28, item 2, single host: at most one success per job-name group; a pin still keeps one beyond it.
    root = str(tmp_path / "root")

    def retain(name: str, days: int, group: str) -> None:
        created = (datetime.now(UTC) - timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")
        args = ["retain", str(make_job(tmp_path, name)), "--root", root, "--namespace", "ci", "--name", name]
        sandkeep(*args, "--created-at", created, "--outcome", "Succeeded", "--label", f"job-name={group}", check=True)

    for name, days, group in (
        ("n-3", 3, "nightly"),
        ("n-2", 2, "nightly"),
        ("n-1", 1, "nightly"),
        ("w-3", 3, "weekly"),
    ):
        retain(name, days, group)
    sandkeep("pin", "ci/n-2", "--root", root, "--for", "29d", check=True)  # past its 30d window: in force
    origin = Manifest.model_validate_json((Path(root) / "ci" / "n-1" / "manifest.json").read_text()).origin
    assert origin is not None and origin.labels == {"job-name": "nightly"}
    limits = ["--retention", "30d", "--history-limits", '{"groupBy": "job-name", "succeeded": 1}']
    rows = json.loads(sandkeep("ls", "--root", root, "-o", "json", *limits, check=True).stdout)["sandboxes"]
    states = {r["name"]: (r["state"], r["reasons"]) for r in rows}
    assert states["n-3"] == ("Expired", [Reason.HISTORY_LIMIT]) and states["n-2"][0] == "Pinned"
    assert states["n-1"][0] == states["w-3"][0] == "Retained"
    swept = sandkeep("sweep", "--root", root, "--once", *limits, *IGNORE, check=True)
    assert "sweep_deleted reason=HistoryLimit entry=ci/n-3" in swept.stderr
    left = json.loads(sandkeep("ls", "--root", root, "-o", "json", check=True).stdout)
    assert sorted(s["name"] for s in left["sandboxes"]) == ["n-1", "n-2", "w-3"]
    bad = sandkeep("sweep", "--root", root, "--once", "--history-limits", '{"groupBy": "team"}')
    assert bad.returncode == 2 and "history limits.groupBy 'team'" in bad.stderr
    no_outcome = sandkeep(
        "retain",
        str(make_job(tmp_path, "x")),
        "--root",
        root,
        "--namespace",
        "ci",
        "--name",
        "x",
        "--label",
        "job-name=a",
    )
    assert no_outcome.returncode == 2 and "--label needs --outcome" in no_outcome.stderr


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


# --- a retain under a taken name replaces only as a deletion would (issue 12, item 5) ------------------------


def _retain_as(root: str, job: Path, name: str = "run", *extra: str) -> subprocess.CompletedProcess[str]:
    return sandkeep("retain", str(job), "--root", root, "--namespace", "ns", "--name", name, *IGNORE, *extra)


def _job_with(tmp_path: Path, name: str) -> Path:
    job = make_job(tmp_path / "jobs", name)
    (job / "marker").write_text(f"{name}\n")
    return job


def _marker(root: str) -> str:
    return (Path(root) / "ns" / "run" / "workspace" / "marker").read_text()


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_retain_never_replaces_a_pinned_sandbox_and_touches_nothing_of_the_source(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first")).returncode == 0
    sandkeep("pin", "ns/run", "--root", root, "--for", "2h", check=True)
    retry = _job_with(tmp_path, "retry")
    out = _retain_as(root, retry, "run", "--exclude", "session")
    assert out.returncode == 1 and "refused to replace it, it is pinned until" in out.stderr, out.stderr
    assert "source is where it was" in out.stderr and "Traceback" not in out.stderr
    assert listing(retry) == ["README", "marker", "session", "src"]  # not even the excluded files went
    assert _marker(root) == "first\n" and listing(Path(root)) == ["ns"]


def test_retain_never_replaces_a_sandbox_a_process_works_in_and_does_once_it_is_free(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first")).returncode == 0
    holder = subprocess.Popen(["sleep", "60"], cwd=Path(root) / "ns" / "run" / "workspace", text=True)
    try:
        retry = _job_with(tmp_path, "retry")
        out = _retain_as(root, retry)
        assert out.returncode == 1, out.stderr
        assert f"refused to replace it (in use: pid {holder.pid} (sleep) cwd" in out.stderr
        assert "source is where it was" in out.stderr and "Traceback" not in out.stderr
        assert listing(retry) == ["README", "marker", "session", "src"] and _marker(root) == "first\n"
        assert listing(Path(root)) == [".sandkeep.lock", "ns"]  # no tombstone: the held one was never renamed
    finally:
        _kill([holder])
    replaced = _retain_as(root, retry)
    assert replaced.returncode == 0 and replaced.stdout.startswith("retained ns/run"), replaced.stderr
    assert "retain_replaced reason=Replaced entry=ns/run" in replaced.stderr
    assert _marker(root) == "retry\n" and not retry.exists()
    assert listing(Path(root)) == [".sandkeep.lock", "ns"] and listing(Path(root) / "ns") == ["run"]


@contextlib.contextmanager
def _recorded_orphan(root: Path) -> Iterator[int]:
    """The pid of `sleep 300` left running in ns/run's workspace by a killed `sandkeep exec`, recorded; killed after."""
    box = root / "ns" / "run"
    recorder = start("exec", "ns/run", "--root", str(root), "--", "sh", "-c", "echo ready; exec sleep 300")
    orphan: int | None = None
    try:
        assert recorder.stdout is not None and recorder.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not list((box / ".commands").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (record,) = [json.loads(p.read_text()) for p in (box / ".commands").glob("*.json")]
        orphan = record["leader"]["pid"]
        recorder.kill()  # the recorder dies; its command runs on in the old sandbox, recorded
        recorder.wait(timeout=10)
        assert Path(f"/proc/{orphan}/cwd").readlink() == box / "workspace"
        yield orphan
    finally:
        _kill([recorder])
        if orphan is not None and Path(f"/proc/{orphan}").exists():
            os.kill(orphan, signal.SIGKILL)


def test_retain_reaps_a_recorded_orphan_of_the_previous_sandbox_before_replacing_it(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first")).returncode == 0
    with _recorded_orphan(Path(root)) as orphan:
        replaced = _retain_as(root, _job_with(tmp_path, "retry"), "run", "--orphan-timeout", "10s")
        assert replaced.returncode == 0, replaced.stderr
        assert "orphans_reaped reason=OrphanReaped object=ns/run" in replaced.stderr
        assert _marker(root) == "retry\n"
        state = Path(f"/proc/{orphan}/stat").read_text() if Path(f"/proc/{orphan}").exists() else "gone) X"
        assert state[state.rfind(")") + 2] in "ZX", state  # killed by the replacement's reap


def test_retain_refuses_a_replacement_while_another_process_holds_the_root_lock(tmp_path: Path) -> None:
    # A sweep (or, in a cluster, the agent) holds the lock for as long as it runs: a new name is retained
    # at once (no deletion), a taken one is refused with exit 3 and what to do, the source left where it was.
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first")).returncode == 0
    sweep = start("sweep", "--root", root, "--interval", "1h", *IGNORE)
    try:
        wait_for_line(sweep, "sweep_pass")
        assert _retain_as(root, _job_with(tmp_path, "other"), "other").returncode == 0
        retry = _job_with(tmp_path, "retry")
        out = _retain_as(root, retry)
        assert out.returncode == 3, out.stderr
        assert (
            f"process {sweep.pid} holds .sandkeep.lock" in out.stderr and "kubectl delete rsb -n ns run" in out.stderr
        )
        assert "source is where it was" in out.stderr and "Traceback" not in out.stderr
        assert listing(retry) == ["README", "marker", "session", "src"] and _marker(root) == "first\n"
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=30) == 0
    finally:
        _kill([sweep])
    assert _retain_as(root, retry).returncode == 0 and _marker(root) == "retry\n"


def test_a_recorded_orphan_that_survives_its_kill_refuses_the_replacement_naming_it(tmp_path: Path) -> None:
    # An orphan that does not die (here: a reaper whose signals do not land, as for a process stuck in D state)
    # holds the previous sandbox exactly as it holds a deletion: the retain is refused, naming the survivor.
    root = Root(tmp_path / "root")
    assert _retain_as(str(root.path), _job_with(tmp_path, "first")).returncode == 0
    signals: list[tuple[int, int]] = []
    reaper = Reaper(
        root,
        in_use_checker(uninspectable_pids()),
        orphan_timeout=timedelta(seconds=0.3),
        kill=lambda target, sig: signals.append((target, sig)),
    )
    retry = _job_with(tmp_path, "retry")
    with _recorded_orphan(root.path) as orphan, contextlib.ExitStack() as stack, pytest.raises(StoreError) as caught:
        now = datetime.now(UTC)
        root.retain(retry, "ns", "run", job_id="j", created_at=now, retention=None, replace=Replacer(reaper, stack))
    assert caught.value.reason is Reason.ORPHAN_SURVIVOR and signals, signals
    assert f"recorded orphan commands survived being killed: pid {orphan} (sleep 300)" in str(caught.value)
    assert "source is where it was" in str(caught.value)
    assert listing(retry) == ["README", "marker", "session", "src"] and _marker(str(root.path)) == "first\n"


def test_retain_never_replaces_a_sandbox_retained_for_a_cluster_node(tmp_path: Path) -> None:
    # Its pins are annotations on its RetainedSandbox, which the command line cannot see: the cluster deletes it.
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first"), "run", "--node", "node-a").returncode == 0
    retry = _job_with(tmp_path, "retry")
    out = _retain_as(root, retry, "run", "--node", "node-a")
    assert out.returncode == 1 and "it was retained for node node-a" in out.stderr, out.stderr
    assert "kubectl delete rsb -n ns run" in out.stderr and "source is where it was" in out.stderr
    assert listing(retry) == ["README", "marker", "session", "src"] and _marker(root) == "first\n"
    assert listing(Path(root)) == ["ns"]  # refused before the lock: nothing of the root was touched


def test_retain_never_replaces_even_an_empty_directory_a_process_works_in(tmp_path: Path) -> None:
    # rename(2) would silently replace an empty directory: the name goes through the pipeline like any other.
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first"), "other").returncode == 0
    empty = Path(root) / "ns" / "run"
    empty.mkdir()
    holder = subprocess.Popen(["sleep", "60"], cwd=empty, text=True)
    try:
        out = _retain_as(root, _job_with(tmp_path, "retry"))
        assert out.returncode == 1 and f"in use: pid {holder.pid} (sleep) cwd" in out.stderr, out.stderr
        assert Path(f"/proc/{holder.pid}/cwd").readlink() == empty and listing(empty) == []
    finally:
        _kill([holder])


@pytest.mark.root
def test_retain_never_replaces_a_sandbox_with_a_mount_inside(tmp_path: Path, mounts: list[Path]) -> None:
    root = str(tmp_path / "root")
    assert _retain_as(root, _job_with(tmp_path, "first")).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("must survive\n")
    point = Path(root) / "ns" / "run" / "workspace" / "src"
    bind_mount(mounts, elsewhere, point)
    out = _retain_as(root, _job_with(tmp_path, "retry"))
    assert out.returncode == 1 and f"in use: mount at {point}" in out.stderr, out.stderr
    assert listing(point) == ["keep.txt"] and _marker(root) == "first\n"
