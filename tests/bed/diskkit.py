"""Shared pieces of the real-filesystem tests: job trees, a throwaway non-root user, immutable files, root checks.

PYTEST_DONT_REWRITE (imported by test modules before pytest_plugins registers it)
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.node import fsdelete
from controller.node.store import Root

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def require_root() -> None:
    """Root-only tests run, never skip: as anyone else they fail saying why."""
    if os.geteuid() != 0:
        pytest.fail("this test needs root (chattr +i, chown to another uid, mounts); the suite runs as root in CI")


@pytest.fixture(params=["threads", "compiled"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which walker deletes directories: fsdelete's threads, or the compiled one (rmtree/) that `make venv` puts
    beside the interpreter. Set through SANDKEEP_RMTREE, so a child process run by the test uses the same."""
    binary = Path(sys.executable).parent / fsdelete.COMPILED
    if request.param == "compiled" and not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing: `make venv` builds it from rmtree/")
    monkeypatch.setenv("SANDKEEP_RMTREE", str(binary) if request.param == "compiled" else "")
    return str(request.param)


# A test that reaches into fsdelete's threads, or that no choice of walker changes.
THREADS_ONLY = pytest.mark.parametrize("engine", ["threads"], indirect=True)


def make_job(parent: Path, name: str = "job", files: int = 5) -> Path:
    """A finished job's directory with a few real files, a nested dir and a transcript."""
    job = parent / name
    (job / "src" / "pkg").mkdir(parents=True)
    for i in range(files):
        (job / "src" / "pkg" / f"f{i}.py").write_text(f"print({i})\n")
    (job / "README").write_text("hello\n")
    (job / "session").mkdir()
    (job / "session" / "transcript.jsonl").write_text('{"secret": "tool output"}\n')
    return job


def outside_bait(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a directory outside every root that links will point at; tests check they survive."""
    bait_dir = tmp_path / "outside"
    bait_dir.mkdir(exist_ok=True)
    (bait_dir / "keep.txt").write_text("must survive\n")
    bait_file = tmp_path / "outside-file.txt"
    bait_file.write_text("must survive too\n")
    return bait_file, bait_dir


def retain(
    root: Root,
    tmp_path: Path,
    ns: str,
    name: str,
    *,
    age: timedelta,
    retention: timedelta | None = None,
    now: datetime = NOW,
) -> Path:
    """Retain a fresh job as `ns/name`, created `age` before `now`."""
    job = make_job(tmp_path / "jobs" / ns, name)
    root.retain(job, ns, name, job_id=f"job-{name}", created_at=now - age, retention=retention, now=now)
    return root.sandbox_path(ns, name)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, *argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
        """Run a command as this user (setpriv: real and effective ids, no supplementary groups)."""
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"}
        return self.run(sys.executable, "-c", code, *args, env=env, cwd="/")


@pytest.fixture
def throwaway_user() -> Iterator[User]:
    """A system user made for this test and deleted after it."""
    require_root()
    name = f"sandkeep-t-{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        ids = subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True).stdout.strip()
        gid = subprocess.run(["id", "-g", name], check=True, capture_output=True, text=True).stdout.strip()
        yield User(name, int(ids), int(gid))
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[list[Path]]:
    """Paths made `chattr +i` by the test; always made mutable again in teardown.

    The whole tmp_path is cleared too (`chattr -R` ignores links): an immutable file may have moved into a
    tombstone, and one left behind would make pytest's own clean-up of old temp dirs fail for everyone.
    """
    made: list[Path] = []
    yield made
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    subprocess.run(["chattr", "-R", "-i", str(tmp_path)], capture_output=True)


def make_immutable(made: list[Path], path: Path) -> None:
    require_root()
    subprocess.run(["chattr", "+i", str(path)], check=True)
    made.append(path)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """Mount points the test made (`bind_mount`); always unmounted in teardown, the last made first.

    Anything still mounted under tmp_path is unmounted too: a mount inside a sandbox moves with the rename
    to its tombstone, so the path it was made at no longer names it.
    """
    made: list[Path] = []
    yield made
    for point in reversed(made):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
    below = f"{os.path.realpath(tmp_path)}/"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split(" ")[4] for line in f]
    for point in sorted((p for p in points if p.startswith(below)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def bind_mount(made: list[Path], source: Path, point: Path) -> None:
    """`mount --bind source point` in this process's mount namespace, unmounted by the `mounts` fixture."""
    require_root()
    subprocess.run(["mount", "--bind", str(source), str(point)], check=True)
    made.append(point)


def open_fds() -> set[str]:
    """This process's open descriptors. Compare as sets: a leak shows as a new one, while another test's
    objects collected meanwhile may close theirs (a count then hides a leak or fails without one)."""
    return set(os.listdir("/proc/self/fd"))


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp dir other users can traverse (pytest's tmp_path sits under a 0700 dir of root's)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="sandkeep-test-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
