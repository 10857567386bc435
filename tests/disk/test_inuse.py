"""In-use detection against real processes, real mounts and the real /proc."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controller.node.fsdelete import delete_tree
from controller.node.inuse import _fs_location, _mounts, scan_usage, uninspectable_pids
from controller.node.store import Root
from controller.rules.contracts import Reason
from tests.bed.diskkit import make_job


@pytest.fixture
def sandboxes(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name in ("a", "b"):
        p = tmp_path / "root" / "ns" / name
        (p / "workspace" / "sub").mkdir(parents=True)
        (p / "workspace" / "file.txt").write_text("x")
        paths[name] = p
    return paths


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


IGNORE = uninspectable_pids()


def _wait_ready(p: subprocess.Popen[bytes]) -> None:
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready"


def _in_own_mount_namespace(script: str, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """`sh -c script` in a private mount namespace (unshare -m), once it printed `ready`."""
    p = subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd="/", stdout=subprocess.PIPE)
    procs.append(p)
    _wait_ready(p)
    return p


def test_a_process_with_its_cwd_inside_holds_only_that_sandbox(sandboxes, procs):
    p = subprocess.Popen(["sleep", "60"], cwd=sandboxes["a"] / "workspace" / "sub")
    procs.append(p)
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["a"].in_use is True
    assert usage["a"].reason is Reason.IN_USE
    assert f"pid {p.pid} (sleep) cwd" in usage["a"].holders
    assert usage["b"].in_use is False and not usage["b"].holds
    p.kill()
    p.wait()
    assert scan_usage(sandboxes, ignore=IGNORE)["a"].in_use is False


def test_an_open_file_descriptor_holds(sandboxes, procs):
    code = "import sys,time; f=open(sys.argv[1]); print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(sandboxes["b"] / "workspace" / "file.txt")],
        cwd="/",
        stdout=subprocess.PIPE,
    )
    procs.append(p)
    _wait_ready(p)
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["b"].in_use is True
    assert any(h.startswith(f"pid {p.pid} (python") and " fd " in h for h in usage["b"].holders)
    assert usage["a"].in_use is False


def test_an_open_file_that_was_deleted_still_holds(sandboxes, procs):
    target = sandboxes["a"] / "workspace" / "gone.txt"
    target.write_text("y")
    code = "import os,sys,time; f=open(sys.argv[1]); os.unlink(sys.argv[1]); print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code, str(target)], cwd="/", stdout=subprocess.PIPE)
    procs.append(p)
    _wait_ready(p)
    assert scan_usage(sandboxes, ignore=IGNORE)["a"].in_use is True


def test_the_scanning_process_itself_can_be_ignored(sandboxes):
    with (sandboxes["a"] / "workspace" / "file.txt").open():
        assert scan_usage(sandboxes, ignore=IGNORE)["a"].in_use is True
        assert scan_usage(sandboxes, ignore=IGNORE | {os.getpid()})["a"].in_use is False


def test_a_pod_hostpath_at_or_below_a_sandbox_holds_but_one_above_does_not(sandboxes):
    root = sandboxes["a"].parent.parent
    usage = scan_usage(
        sandboxes,
        ignore=IGNORE,
        pod_paths=[("ci/runner-1", sandboxes["a"] / "workspace"), ("kube-system/sandkeep-agent-x", root)],
    )
    assert usage["a"].in_use is True
    assert usage["a"].reason is Reason.POD_MOUNT
    assert usage["a"].holders == (f"pod ci/runner-1 hostPath {sandboxes['a'] / 'workspace'}",)
    assert usage["b"].in_use is False


def test_a_mount_on_a_directory_inside_a_sandbox_holds(sandboxes, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    point = sandboxes["a"] / "workspace" / "sub"
    subprocess.run(["mount", "--bind", str(elsewhere), str(point)], check=True)
    try:
        usage = scan_usage(sandboxes, ignore=IGNORE)
        assert usage["a"].in_use is True
        assert f"mount at {point}" in usage["a"].holders
        assert usage["a"].pids == frozenset() and not usage["a"].only_pids  # a mount outlives any one process
        assert usage["b"].in_use is False
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_bind_of_a_sandbox_in_another_mount_namespace_holds(sandboxes, tmp_path, procs):
    # The process neither has its cwd nor a file inside: only its private mount namespace binds the sandbox.
    target = tmp_path / "target"
    target.mkdir()
    script = f"mount --bind {sandboxes['b']} {target} && echo ready && exec sleep 60"
    _in_own_mount_namespace(script, procs)
    assert str(target) not in Path("/proc/self/mountinfo").read_text()
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["b"].in_use is True
    assert any("mount namespace" in h for h in usage["b"].holders)
    assert usage["a"].in_use is False


def test_a_process_inside_a_sandbox_seen_through_another_namespaces_bind_of_the_root_holds(sandboxes, tmp_path, procs):
    # A container-like namespace binds the whole root at another path and works inside one sandbox
    # through it: its cwd reads as the bind's path, which no host path matches.
    root = sandboxes["a"].parent.parent
    view = tmp_path / "view"
    view.mkdir()
    script = f"mount --bind {root} {view} && cd {view}/ns/a/workspace && echo ready && exec sleep 60"
    p = _in_own_mount_namespace(script, procs)
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["a"].in_use is True
    assert any(h.startswith(f"pid {p.pid} (sleep) cwd") for h in usage["a"].holders)
    assert usage["b"].in_use is False


def _without_capabilities(code: str, *args: str) -> str:
    """Run `code` as root stripped of every capability (no CAP_SYS_PTRACE): what a badly deployed agent sees."""
    return subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout


def test_a_process_the_scan_cannot_inspect_makes_the_answer_unknown(sandboxes):
    # A scan with no capabilities cannot read the processes that have some: "unknown", never "free".
    code = (
        "import sys\nfrom pathlib import Path\nfrom controller.node.inuse import scan_usage\n"
        "u = scan_usage({'a': Path(sys.argv[1])})['a']\n"
        "print(u.in_use, u.reason, u.holds)"
    )
    out = _without_capabilities(code, str(sandboxes["a"]))
    assert out.split() == ["None", "InUseUnknown", "True"]


def test_the_holding_pids_are_carried_and_only_processes_alone_can_release_a_sandbox(sandboxes, procs):
    # The agent does not count a sandbox's recorded orphans as users: that needs the pids behind the
    # holders, and to know that nothing else (a Pod, a mount, a process nobody can inspect) holds it.
    by_cwd = subprocess.Popen(["sleep", "60"], cwd=sandboxes["a"] / "workspace")
    code = "import sys,time; f=open(sys.argv[1]); print('ready', flush=True); time.sleep(60)"
    by_fd = subprocess.Popen(
        [sys.executable, "-c", code, str(sandboxes["a"] / "workspace" / "file.txt")], cwd="/", stdout=subprocess.PIPE
    )
    beside_a_pod = subprocess.Popen(["sleep", "60"], cwd=sandboxes["b"] / "workspace")
    procs.extend([by_cwd, by_fd, beside_a_pod])
    _wait_ready(by_fd)

    usage = scan_usage(sandboxes, ignore=IGNORE, pod_paths=[("ci/runner-1", sandboxes["b"] / "workspace")])

    a, b = usage["a"], usage["b"]
    assert a.pids == {by_cwd.pid, by_fd.pid} and a.only_pids
    assert a.held_only_by({by_cwd.pid, by_fd.pid, 1})
    assert not a.held_only_by({by_cwd.pid})  # the other holder still uses it
    assert b.pids == {beside_a_pod.pid} and not b.only_pids
    assert not b.held_only_by({beside_a_pod.pid})  # the Pod still mounts it


def test_a_process_holder_beside_a_process_nobody_can_inspect_is_not_the_only_holder(sandboxes):
    # A scan without capabilities sees its own (equally powerless) child, not the machine's other processes.
    code = (
        "import subprocess, sys\nfrom pathlib import Path\nfrom controller.node.inuse import scan_usage\n"
        "holder = subprocess.Popen(['sleep', '60'], cwd=sys.argv[1])\n"
        "u = scan_usage({'a': Path(sys.argv[1])})['a']\n"
        "holder.kill()\nholder.wait()\n"
        "print(u.in_use, u.pids == {holder.pid}, u.only_pids, u.held_only_by({holder.pid}))"
    )
    out = _without_capabilities(code, str(sandboxes["a"]))
    assert out.split() == ["True", "True", "False", "False"]


def test_a_process_that_vanishes_mid_scan_is_not_an_error(sandboxes, tmp_path):
    # A /proc snapshot where pid 4242 left between the listing and the readlinks: its entries are gone.
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text("")
    (proc / "4242").mkdir()
    (proc / "4243" / "fd").mkdir(parents=True)
    (proc / "4243" / "cwd").symlink_to(sandboxes["a"])
    (proc / "4243" / "maps").write_text("")
    usage = scan_usage(sandboxes, proc=proc)
    assert usage["a"].in_use is True
    assert usage["b"].in_use is False


def test_one_pass_answers_many_sandboxes(tmp_path):
    paths = {i: tmp_path / "root" / "ns" / f"s{i}" for i in range(2000)}
    for p in paths.values():
        p.mkdir(parents=True)
    usage = scan_usage(paths, ignore=IGNORE)
    assert len(usage) == 2000
    assert all(u.in_use is False for u in usage.values())


# --- targets deeper than PATH_MAX: readlink says ENAMETOOLONG, the kernel still knows where they are ------

DEEP_CWD = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    below = os.open('d', os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)\n"
    "    os.close(fd)\n"
    "    fd = below\n"
    "os.fchdir(fd)  # the cwd, and an open fd, both deeper than PATH_MAX\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
DEPTH = 2100  # "d/" x 2100: 4200+ bytes, past PATH_MAX (4096) whatever the tmp path


@pytest.fixture
def deep_trees() -> Iterator[list[Path]]:
    """Deep chains are deleted by the test itself: pytest's recursive tmp clean-up cannot (RecursionError)."""
    made: list[Path] = []
    yield made
    for top in made:
        result = delete_tree(top.parent, top.name)
        assert result.ok, result


def _deep_chain(top: Path, depth: int, made: list[Path]) -> None:
    """`top/d/d/.../d`, built fd-relative (no path to it fits in PATH_MAX)."""
    top.mkdir(parents=True)
    made.append(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


def _deep_process(top: Path, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", DEEP_CWD, str(top), str(DEPTH)], stdout=subprocess.PIPE)
    procs.append(p)
    _wait_ready(p)
    with pytest.raises(OSError) as err:
        (Path(f"/proc/{p.pid}") / "cwd").readlink()
    assert err.value.errno == errno.ENAMETOOLONG  # the case under test: its cwd cannot be named
    return p


def test_a_process_deep_in_another_tree_leaves_every_sandbox_free_not_unknown(sandboxes, tmp_path, procs, deep_trees):
    _deep_chain(tmp_path / "elsewhere", DEPTH, deep_trees)
    _deep_process(tmp_path / "elsewhere", procs)
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["a"].in_use is False and usage["b"].in_use is False, usage


def test_a_process_deep_inside_a_sandbox_holds_that_sandbox(sandboxes, procs, deep_trees):
    top = sandboxes["a"] / "workspace" / "deep"
    _deep_chain(top, DEPTH, deep_trees)
    p = _deep_process(top, procs)
    usage = scan_usage(sandboxes, ignore=IGNORE)
    assert usage["a"].in_use is True and usage["a"].reason is Reason.IN_USE
    comm = Path(f"/proc/{p.pid}/comm").read_text().strip()  # python or python3, as the venv named it
    assert f"pid {p.pid} ({comm}) cwd (deeper than PATH_MAX)" in usage["a"].holders
    assert usage["b"].in_use is False


def test_processes_nobody_may_inspect_are_named_so_an_operator_can_act(procs):
    # Without CAP_SYS_PTRACE another uid's process cannot be inspected: it is exactly what the agent
    # warns about at start (every answer would be unknown), and what `--ignore-pid` vouches for.
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    procs.append(other)
    code = "from controller.node.inuse import uninspectable_pids; print(*uninspectable_pids())"
    blind = _without_capabilities(code)
    assert str(other.pid) in blind.split()
    assert other.pid not in uninspectable_pids()  # root with its capabilities sees it fine


# --- a mountinfo that cannot be read is "unknown", never "no mounts" (issue 12, item 6) --------------------


def test_a_scan_that_cannot_read_its_own_mountinfo_answers_unknown_not_free(sandboxes, tmp_path, procs):
    # A procfs of another PID namespace has no `self` for this process: the scan's own mountinfo is ENOENT.
    # It used to read as "no mounts", so the bind mount inside `a` (and every other) went unseen: free.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    point = sandboxes["a"] / "workspace" / "sub"
    subprocess.run(["mount", "--bind", str(elsewhere), str(point)], check=True)
    script = "echo ready; exec sleep 60"
    p = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", script], stdout=subprocess.PIPE
    )
    procs.append(p)
    try:
        _wait_ready(p)
        (child,) = map(int, Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split())
        proc = Path(f"/proc/{child}/root/proc")
        assert not (proc / "self").exists() and (proc / "1" / "mountinfo").exists()
        usage = scan_usage(sandboxes, proc=proc)
        for name in ("a", "b"):
            assert usage[name].in_use is None and usage[name].reason is Reason.IN_USE_UNKNOWN, usage
            assert any("own mountinfo cannot be read: ENOENT" in h for h in usage[name].holders)
    finally:
        subprocess.run(["umount", str(point)], check=True)


EMFILE_REAP = """
import json, os, resource, sys
from pathlib import Path
from controller.rules.contracts import Reason
from controller.node.reaper import Claim, Reaper, Target
from controller.cli.sweep import in_use_checker
from controller.node.store import Root

root, free, ignore = Root(sys.argv[1], create=False), int(sys.argv[2]), json.loads(sys.argv[3])
check = in_use_checker(ignore)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

def out_of_fds(path):
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    for _ in range(free):
        os.close(held.pop())
    try:
        return check(path)
    finally:
        for fd in held:
            os.close(fd)

reaper = Reaper(root, out_of_fds)
outcome = reaper.reap(Target("ns", "a", "emfile", Claim(decided=root.read("ns", "a")), Reason.EXPIRED))
print(json.dumps([type(outcome).__name__, outcome.reason]))
"""


@pytest.mark.parametrize("holder", ["a mount inside it", "a bind of it in another mount namespace"])
def test_a_scan_out_of_file_descriptors_holds_and_nothing_is_deleted(tmp_path, procs, holder):
    # EMFILE at every point of the scan (0 to 5 descriptors left): each answer holds (in use, or unknown
    # when a mountinfo or a process could not be read, or the scan failed), and the sandbox is never renamed.
    root = Root(tmp_path / "root")
    root.retain(make_job(tmp_path), "ns", "a", job_id="j", created_at=datetime.now(UTC), retention=None)
    sandbox = root.sandbox_path("ns", "a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("must survive\n")
    point = sandbox / "workspace" / "src"
    if holder == "a mount inside it":
        subprocess.run(["mount", "--bind", str(elsewhere), str(point)], check=True)
    else:
        _in_own_mount_namespace(f"mount --bind {sandbox} {elsewhere} && echo ready && exec sleep 60", procs)
    try:
        before = sorted(str(p.relative_to(root.path)) for p in root.path.rglob("*"))
        for free in range(6):
            out = subprocess.run(
                [sys.executable, "-c", EMFILE_REAP, str(root.path), str(free), json.dumps(sorted(IGNORE))],
                capture_output=True,
                text=True,
                check=True,
                cwd="/",
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            )
            kind, reason = json.loads(out.stdout)
            assert kind == "Held" and reason in (Reason.IN_USE, Reason.IN_USE_UNKNOWN), (free, out.stdout)
            assert sorted(str(p.relative_to(root.path)) for p in root.path.rglob("*")) == before
        assert (elsewhere / "keep.txt").read_text() == "must survive\n"
    finally:
        if holder == "a mount inside it":
            subprocess.run(["umount", str(point)], check=True)


def test_a_process_that_exits_mid_read_does_not_hide_its_namespaces_mounts(sandboxes, tmp_path):
    # A /proc snapshot: pids 4232-4242 left after their namespace link was read (their mountinfo is gone); 4243, in
    # the same namespace, is alive and that namespace binds sandbox b. The namespace is read through 4243.
    own = Path("/proc/self/mountinfo").read_text()
    dev, fs_path = _fs_location(str(sandboxes["b"].resolve()), _mounts(own))
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(own)
    for pid in range(4243, 4231, -1):  # one alive among twelve: it is almost never the first one listed
        (proc / str(pid) / "ns").mkdir(parents=True)
        (proc / str(pid) / "ns" / "mnt").symlink_to("mnt:[4026599999]")
        (proc / str(pid) / "fd").mkdir()
        (proc / str(pid) / "maps").write_text("")
    (proc / "4243" / "mountinfo").write_text(f"{own}999 1 {dev} {fs_path} /srv/b rw - ext4 /dev/x rw\n")
    usage = scan_usage(sandboxes, proc=proc)
    assert usage["b"].in_use is True and any("mounts" in h and "/srv/b" in h for h in usage["b"].holders)
    assert usage["a"].in_use is False
