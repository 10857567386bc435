"""`kubectl sandkeep` against the real API server: ls, pin, unpin, doctor, and open/cp up to the exec.

No controller runs here: where a session must move on, the test plays the controller's part by writing
the session's status itself. The exec step (a real Pod on a real node) is the end-to-end tests'; here a
stand-in `kubectl` first on PATH records the exec it is asked for and answers as a Pod would.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.api.kube import AGENT_MANAGER, CONTROLLER_MANAGER, Kube, session_path
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from tests.bed.controller_harness import install_crds, kube_for, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def crds(cluster: Any) -> None:
    install_crds(cluster)


@pytest.fixture
def client(cluster: Any, crds: None) -> Any:
    kube = kube_for(cluster)
    yield kube
    kube.close()


def plugin(cluster: Any, *args: str, kubeconfig: Path | None = None, env: dict[str, str] | None = None) -> Any:
    command = [
        sys.executable,
        "-m",
        "controller.cli.kubectl_plugin",
        f"--kubeconfig={kubeconfig or cluster.kubeconfig}",
        *args,
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=90, env=env)


def start_plugin(cluster: Any, *args: str, kubeconfig: Path | None = None, env: dict[str, str] | None = None) -> Any:
    command = [
        sys.executable,
        "-m",
        "controller.cli.kubectl_plugin",
        f"--kubeconfig={kubeconfig or cluster.kubeconfig}",
        *args,
    ]
    return subprocess.Popen(
        command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def make(
    client: Kube,
    namespace: str,
    name: str,
    node: str = "node-a",
    status: dict[str, Any] | None = None,
    origin: dict[str, Any] | None = None,
) -> Any:
    spec = {"nodeName": node, "createdAt": "2026-01-01T00:00:00Z", **({"origin": origin} if origin else {})}
    body = {"metadata": {"name": name}, "spec": spec}
    obj = client.create_sandbox(namespace, body)
    return obj if status is None else client.apply_status(obj, status, CONTROLLER_MANAGER)


def sessions(client: Kube, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.request("GET", session_path(namespace)).get("items", [])
    return items


def set_session_status(client: Kube, namespace: str, name: str, status: dict[str, Any]) -> None:
    """The controller's part, played by the test: the session's status as the controller would write it."""
    client.request(
        "PATCH",
        session_path(namespace, name) + "/status",
        body={"status": status},
        content_type="application/merge-patch+json",
    )


def the_session(client: Kube, namespace: str) -> dict[str, Any]:
    return wait_for("the plugin's SandboxSession", lambda: next(iter(sessions(client, namespace)), None))


# --- ls -----------------------------------------------------------------------------------------------
@pytest.fixture
def two(client: Kube, namespace: str) -> dict[str, str]:
    soon = format_instant(datetime.now(UTC) + timedelta(hours=3, minutes=1))
    later = format_instant(datetime.now(UTC) + timedelta(days=5, minutes=1))
    make(
        client,
        namespace,
        "run-42",
        "node-a",
        {"phase": "Retained", "deadline": soon, "deadlineSource": "window"},
    )
    obj = make(client, namespace, "run-43", "node-b")
    client.apply_status(
        obj, {"phase": "Pinned", "deadline": later, "deadlineSource": "pin", "pinnedUntil": later}, CONTROLLER_MANAGER
    )
    client.apply_status(
        obj,
        {"sizeBytes": 962560, "fileCount": 41, "inUse": True, "heldBy": ["pid 42 (bash) cwd", "pod x/y"]},
        AGENT_MANAGER,
    )
    return {"soon": soon, "later": later}


def test_ls_prints_a_table_with_size_deadline_pin_and_holders(cluster, namespace, two):
    result = plugin(cluster, "ls", "-n", namespace)
    assert result.returncode == 0, result.stderr
    header, first, second = result.stdout.splitlines()
    assert header.split() == ["NAME", "NODE", "PHASE", "SIZE", "DEADLINE", "PIN", "HOLDERS"]
    assert first.split()[:4] == ["run-42", "node-a", "Retained", "<unknown>"]
    assert f"{two['soon']} (in 3h" in first and "<none>" in first
    assert second.split()[:4] == ["run-43", "node-b", "Pinned", "940.0K"]
    assert f"{two['later']} (in 5d" in second and "pid 42 (bash) cwd (+1)" in second


def test_ls_wide_adds_files_bytes_and_the_deadline_source(cluster, namespace, two):
    result = plugin(cluster, "ls", "-n", namespace, "-o", "wide")
    assert result.returncode == 0, result.stderr
    header, _first, second = result.stdout.splitlines()
    assert header.split()[-3:] == ["FILES", "BYTES", "SOURCE"]
    assert second.split()[-3:] == ["41", "962560", "pin"]


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_ls_json_and_yaml_print_a_kubectl_list_of_the_objects(cluster, namespace, two, output):
    result = plugin(cluster, "ls", "-n", namespace, "-o", output)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout) if output == "json" else yaml.safe_load(result.stdout)
    assert doc["kind"] == "List" and doc["apiVersion"] == "v1"
    assert [i["metadata"]["name"] for i in doc["items"]] == ["run-42", "run-43"]
    assert {i["kind"] for i in doc["items"]} == {c.SANDBOX_KIND}
    assert doc["items"][1]["status"]["sizeBytes"] == 962560


def test_ls_all_namespaces_adds_the_namespace_column(cluster, namespace, two):
    result = plugin(cluster, "ls", "-A")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[0] == "NAMESPACE"
    mine = [line.split()[:2] for line in lines if line.startswith(namespace + " ")]
    assert mine == [[namespace, "run-42"], [namespace, "run-43"]]


def test_ls_node_filters_on_the_server(cluster, namespace, two):
    result = plugin(cluster, "ls", "-n", namespace, "--node", "node-b")
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == ["run-43"]
    empty = plugin(cluster, "ls", "-n", namespace, "--node", "node-z")
    assert empty.returncode == 0 and empty.stdout == ""
    assert f"No resources found in {namespace} namespace." in empty.stderr


def test_the_namespace_defaults_to_the_contexts_and_context_picks_one(cluster, namespace, two, tmp_path):
    config = json.loads(Path(cluster.kubeconfig).read_text())
    config["contexts"][0]["context"]["namespace"] = namespace
    other = {"name": "other", "context": {**config["contexts"][0]["context"], "namespace": "kube-system"}}
    config["contexts"].append(other)
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    mine = plugin(cluster, "ls", kubeconfig=path)
    assert mine.returncode == 0, mine.stderr
    assert "run-42" in mine.stdout
    theirs = plugin(cluster, "--context", "other", "ls", kubeconfig=path)
    assert theirs.returncode == 0 and "No resources found in kube-system namespace." in theirs.stderr
    unknown = plugin(cluster, "ls", "--context", "nope", kubeconfig=path)
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: ") and "--context" in unknown.stderr


def test_kubectl_finds_the_plugin_on_path(cluster, namespace, two):
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{cluster.bin}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["kubectl", "sandkeep", "ls", f"--kubeconfig={cluster.kubeconfig}", "-n", namespace],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "run-43" in result.stdout


# --- pin, unpin ----------------------------------------------------------------------------------------
def annotations(client: Kube, namespace: str, name: str) -> dict[str, str]:
    obj = client.get_sandbox(namespace, name)
    assert obj is not None
    return {k: v for k, v in (obj["metadata"].get("annotations") or {}).items() if k.startswith(c.GROUP)}


def test_pin_for_until_and_unpin_write_the_annotations(cluster, namespace, client):
    make(client, namespace, "run-42")
    pinned = plugin(cluster, "pin", "run-42", "-n", namespace, "--for", "72h")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.startswith(
        f"retainedsandbox.sandkeep.io/run-42 pinned for 72h (until {datetime.now(UTC).year}"
    )
    assert annotations(client, namespace, "run-42") == {c.ANN_PIN_FOR: "72h"}

    until = plugin(cluster, "-n", namespace, "pin", "run-42", "--until", "2099-12-24T18:00:00+01:00")
    assert until.returncode == 0, until.stderr
    assert until.stdout == "retainedsandbox.sandkeep.io/run-42 pinned until 2099-12-24T17:00:00Z\n"
    assert annotations(client, namespace, "run-42") == {c.ANN_PIN_UNTIL: "2099-12-24T17:00:00Z"}

    unpinned = plugin(cluster, "unpin", "run-42", "-n", namespace)
    assert unpinned.returncode == 0 and unpinned.stdout == "retainedsandbox.sandkeep.io/run-42 unpinned\n"
    assert annotations(client, namespace, "run-42") == {}
    again = plugin(cluster, "unpin", "run-42", "-n", namespace)
    assert again.returncode == 0 and "not pinned" in again.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--for", "next week"], "--for 'next week': not a duration"),
        (["--for", "0"], "pins nothing"),
        (["--until", "tomorrow"], "not an RFC 3339 time"),
        (["--until", "2020-01-01T00:00:00Z"], "is in the past"),
        ([], "exactly one of --for"),
        (["--for", "1h", "--until", "2099-01-01T00:00:00Z"], "exactly one of --for"),
    ],
)
def test_pin_refuses_bad_input_and_changes_nothing(cluster, namespace, client, args, said):
    before = make(client, namespace, "run-42")
    result = plugin(cluster, "pin", "run-42", "-n", namespace, *args)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and said in result.stderr and result.stdout == ""
    after = client.get_sandbox(namespace, "run-42")
    assert after is not None and after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_pin_of_a_missing_sandbox_says_how_to_list_them(cluster, namespace, crds):
    result = plugin(cluster, "pin", "nope", "-n", namespace, "--for", "1h")
    assert result.returncode == 1
    assert (
        result.stderr
        == f"error: retainedsandbox nope not found in namespace {namespace}; kubectl sandkeep ls -n {namespace}\n"
    )


# --- doctor --------------------------------------------------------------------------------------------
def test_doctor_is_sandkeep_doctors_report_and_exits_non_zero_on_a_stuck_sandbox(cluster, namespace, client):
    make(client, namespace, "fine")
    stuck = make(client, namespace, "stuck", "node-a")
    client.apply_status(stuck, {"phase": "Stuck"}, AGENT_MANAGER)
    command = [sys.executable, "-m", "controller.cli.sandkeep", "doctor", "--kubeconfig", str(cluster.kubeconfig)]
    command += ["--namespace", namespace, "--sandbox-namespace", namespace]
    theirs = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    ours = plugin(cluster, "doctor", "-n", namespace, "--install-namespace", namespace)
    assert ours.returncode == theirs.returncode == 1, ours.stderr + theirs.stderr
    assert ours.stdout == theirs.stdout
    assert f"{namespace}/stuck" in ours.stdout and f"{namespace}/fine" not in ours.stdout
    assert ours.stdout.rstrip().endswith("sandkeep doctor: needs a person")

    scripted = plugin(cluster, "doctor", "-n", namespace, "--install-namespace", namespace, "-o", "json")
    assert scripted.returncode == 1
    doc = json.loads(scripted.stdout)
    assert doc["needsAPerson"] is True
    assert [row["sandbox"] for row in doc["stuck"]] == [f"{namespace}/stuck"]


# --- open, cp: refused before anything is created ------------------------------------------------------
@pytest.mark.parametrize(
    ("setup", "args", "said"),
    [
        ("none", ["open", "nope"], "retainedsandbox nope not found in namespace {ns}; kubectl sandkeep ls -n {ns}"),
        ("expired", ["open", "run-42"], "RetainedSandbox {ns}/run-42 is expired (deadline 2026-"),
        ("stuck", ["open", "run-42"], "is Stuck mid-deletion on its node; see `kubectl sandkeep doctor`"),
        ("orphans", ["open", "run-42"], "has commands that survived their reaping: pid 7"),
        ("fine", ["open", "run-42", "--lifetime", "soon"], "--lifetime 'soon': not a duration"),
        ("fine", ["open", "run-42", "--lifetime", "0"], "--lifetime 0"),
        ("fine", ["open", "run-42", "--as-job"], "records no container that mounted its workspace whole"),
        ("fine", ["cp", "run-42:/etc/passwd", "out"], "is not a path inside the workspace"),
        ("fine", ["cp", "run-42:logs/../../x", "out"], "leaves the workspace"),
        ("fine", ["cp", "run-42", "out"], "NAME:PATH"),
        ("none", ["cp", "nope:logs", "out"], "retainedsandbox nope not found"),
    ],
)
def test_open_and_cp_refuse_locally_and_create_no_session(cluster, namespace, client, tmp_path, setup, args, said):
    if setup != "none":
        survived = {
            "type": c.Condition.ORPHANS_SURVIVED,
            "status": "True",
            "reason": "OrphanSurvivor",
            "message": "pid 7",
        }
        status = {
            "expired": {"phase": "Expired", "deadline": "2026-01-02T03:04:05Z"},
            "stuck": {"phase": "Stuck"},
            "orphans": {"phase": "Retained", "conditions": [survived | {"lastTransitionTime": "2026-01-02T03:04:05Z"}]},
            "fine": {"phase": "Retained"},
        }[setup]
        make(client, namespace, "run-42", status=status)
    result = plugin(cluster, *args, "-n", namespace)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and said.format(ns=namespace) in line
    listed = cluster.kubectl("get", c.SESSION_SHORT, "-n", namespace, "-o", "name").stdout
    assert listed == ""
    assert not (tmp_path / "out").exists()


# --- open: the session, up to the exec -----------------------------------------------------------------
@pytest.fixture
def alice(cluster: Any, namespace: str, tmp_path: Path) -> tuple[str, Path]:
    """A person who may read sandboxes and create sessions in the namespace, with a real token."""
    cluster.kubectl("create", "serviceaccount", "alice", "-n", namespace)
    cluster.kubectl("create", "role", "opener", "-n", namespace, "--verb=get,list", f"--resource={c.SANDBOX_PLURAL}")
    cluster.kubectl(
        "create", "role", "sessions", "-n", namespace, "--verb=create,get,delete", f"--resource={c.SESSION_PLURAL}"
    )
    for role in ("opener", "sessions"):
        cluster.kubectl(
            "create", "rolebinding", role, "-n", namespace, f"--role={role}", f"--serviceaccount={namespace}:alice"
        )
    token = cluster.token_for(namespace, "alice")
    return f"system:serviceaccount:{namespace}:alice", cluster.kubeconfig_for_token(
        token, tmp_path / "alice.kubeconfig"
    )


def test_open_creates_the_callers_session_and_a_refusal_is_its_error(cluster, namespace, client, alice):
    user, kubeconfig = alice
    sandbox = make(client, namespace, "run-42", status={"phase": "Retained"})
    proc = start_plugin(cluster, "open", "run-42", "-n", namespace, kubeconfig=kubeconfig)
    try:
        session = the_session(client, namespace)
        name = session["metadata"]["name"]
        assert session["metadata"]["generateName"] == "run-42-"
        assert session["spec"] == {"sandbox": "run-42", "user": user, "readWrite": False, "lifetime": "1h"}
        set_session_status(
            client, namespace, name, {"phase": "Pending", "reason": "SessionStarting", "message": "pod starting"}
        )
        time.sleep(1.5)  # the plugin reads the status twice a second; it says each change once
        refusal = "demo/run-42 expired at 2026-01-02T00:00:00Z; pin it before it expires"
        set_session_status(client, namespace, name, {"phase": "Refused", "reason": "Expired", "message": refusal})
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert f"waiting for session {name}: SessionStarting: pod starting" in err
    assert err.strip().splitlines()[-1] == f"error: sandboxsession {name} refused: Expired: {refusal}"
    assert sessions(client, namespace) == []  # its own session deleted ...
    after = client.get_sandbox(namespace, "run-42")  # ... and nothing else touched
    assert after is not None and after["metadata"]["resourceVersion"] == sandbox["metadata"]["resourceVersion"]


def test_session_name_is_cut_to_a_dns_label(cluster, namespace, client):
    long = "a" * 60 + "-b"
    make(client, namespace, long, status={"phase": "Retained"})
    proc = start_plugin(cluster, "open", long, "-n", namespace, "--timeout", "3s")
    try:
        session = the_session(client, namespace)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert len(session["metadata"]["name"]) <= 63 and session["spec"]["sandbox"] == long
    assert proc.returncode == 1 and "not running after 3s" in err and "is the sandkeep controller running?" in err
    assert sessions(client, namespace) == []


def fake_kubectl(tmp_path: Path, exit_code: int = 0, tar: Path | None = None) -> dict[str, str]:
    """A `kubectl` first on PATH that records its arguments, prints `tar` and exits with `exit_code`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    out = f'cat "{tar}"\n' if tar else ""
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/kubectl.args"\n{out}exit {exit_code}\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def run_until_running(cluster: Any, client: Kube, namespace: str, args: list[str], env: dict[str, str]) -> Any:
    proc = start_plugin(cluster, "-n", namespace, *args, env=env)  # -n first: after `--` is the command
    try:
        session = the_session(client, namespace)
        # The session's Pod runs in the sandbox's own namespace (issue 27): exec there, as the user themselves.
        running = {"phase": "Running", "reason": "SessionRunning", "podName": "sess-1", "podNamespace": namespace}
        set_session_status(client, namespace, session["metadata"]["name"], running)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return session, proc.returncode, out, err


def test_open_execs_in_the_sessions_pod_returns_its_exit_code_and_ends_the_session(
    cluster, namespace, client, tmp_path
):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    env = fake_kubectl(tmp_path, exit_code=7)
    args = ["open", "run-42", "--rw", "--image", "busybox:1.36", "--lifetime", "30m", "--", "ls", "-la"]
    session, code, _out, err = run_until_running(cluster, client, namespace, args, env)
    assert session["spec"]["readWrite"] is True and session["spec"]["image"] == "busybox:1.36"
    assert session["spec"]["lifetime"] == "30m"
    assert code == 7, err
    argv = (tmp_path / "kubectl.args").read_text().splitlines()
    assert argv == [
        f"--kubeconfig={cluster.kubeconfig}",
        "exec",
        "-i",  # stdin is no terminal here: no -t
        "-n",
        namespace,
        "sess-1",
        "-c",
        c.SESSION_CONTAINER,
        "--",
        "ls",
        "-la",
    ]
    assert sessions(client, namespace) == []


def test_open_as_job_asks_for_the_jobs_container_and_says_where_and_as_whom(cluster, namespace, client, tmp_path):
    job = {"name": "build", "image": "registry.example/build:7", "workingDir": "/src/app", "mountPath": "/src"}
    origin = {"pod": "build-x", "outcome": "Failed", "containers": [job]}
    make(client, namespace, "run-42", status={"phase": "Retained", "owner": {"uid": 0, "gid": 0}}, origin=origin)
    session, code, _out, err = run_until_running(
        cluster, client, namespace, ["open", "run-42", "--as-job", "--", "pwd"], fake_kubectl(tmp_path)
    )
    assert code == 0, err
    assert session["spec"]["asJob"] is True and "image" not in session["spec"]
    assert "at /src in registry.example/build:7" in err
    assert "owned by root and the session is not root" in err and "Permission denied" in err


def test_open_keep_leaves_the_session(cluster, namespace, client, tmp_path):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    session, code, _out, err = run_until_running(
        cluster, client, namespace, ["open", "run-42", "--keep"], fake_kubectl(tmp_path)
    )
    assert code == 0, err
    argv = (tmp_path / "kubectl.args").read_text().splitlines()
    assert argv[-4:] == ["--", "sh", "-c", f'cd {c.SESSION_MOUNT} && exec "${{SHELL:-sh}}"']
    assert [s["metadata"]["name"] for s in sessions(client, namespace)] == [session["metadata"]["name"]]
    assert f"kubectl delete {c.SESSION_SHORT} {session['metadata']['name']} -n {namespace}" in err


# --- cp ------------------------------------------------------------------------------------------------
def tar_of(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for info, data in members:
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data else None)
    path.write_bytes(buf.getvalue())
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def test_cp_copies_a_workspace_path_out_through_a_read_only_session(cluster, namespace, client, tmp_path):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    archive = tar_of(tmp_path / "out.tar", [(member("logs/build.log"), b"ok\n")])
    dest = tmp_path / "dest"
    session, code, _out, err = run_until_running(
        cluster, client, namespace, ["cp", "run-42:work/logs", str(dest)], fake_kubectl(tmp_path, tar=archive)
    )
    assert code == 0, err
    assert session["spec"]["readWrite"] is False
    assert (dest / "logs" / "build.log").read_text() == "ok\n"
    argv = (tmp_path / "kubectl.args").read_text().splitlines()
    assert argv[argv.index("--") :] == ["--", "tar", "cf", "-", "-C", f"{c.SESSION_MOUNT}/work", "--", "logs"]
    assert "-i" not in argv and "-it" not in argv
    assert sessions(client, namespace) == []


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (member("../escape"), "a '..' component"),
        (member("/abs"), "an absolute path"),
        (member("link", tarfile.SYMTYPE, "/etc"), "a symbolic link (to '/etc')"),
        (member("link", tarfile.SYMTYPE, "../../outside"), "a symbolic link (to '../../outside')"),
        (member("passwd", tarfile.LNKTYPE, "/etc/passwd"), "a hard link (to '/etc/passwd')"),
        (member("tty", tarfile.CHRTYPE), "a character device"),
    ],
    ids=["dotdot", "absolute", "absolute-link", "escaping-link", "hardlink", "device"],
)
def test_cp_refuses_members_that_are_not_files_or_directories_inside_dest(
    cluster, namespace, client, tmp_path, bad, why
):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    body = b"x" if bad.isreg() else b""
    archive = tar_of(tmp_path / "out.tar", [(member("ok.log"), b"ok\n"), (bad, body), (member("z.log"), b"z\n")])
    dest = tmp_path / "dest"
    _session, code, _out, err = run_until_running(
        cluster, client, namespace, ["cp", "run-42:logs", str(dest)], fake_kubectl(tmp_path, tar=archive)
    )
    assert code == 1
    assert f"warning: refused to unpack {bad.name!r}: {why}" in err
    assert (
        err.strip().splitlines()[-1] == f"error: refused 1 entry of logs (see the warnings above); copied 2 to {dest}"
    )
    assert sorted(p.name for p in dest.iterdir()) == ["ok.log", "z.log"]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()
    assert sessions(client, namespace) == []


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ("not-empty", "dest is not empty; give a new or empty directory, or --merge to add to it"),
        ("link", "dest is a symbolic link; cp never writes through a link"),
        ("file", "dest exists and is not a directory"),
        ("no-parent", "does not exist; create it first (cp creates DEST, not its parents)"),
    ],
)
def test_cp_refuses_a_dest_it_would_not_write_into_before_any_session(
    cluster, namespace, client, tmp_path, setup, said
):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    dest = tmp_path / "dest"
    (tmp_path / "real").mkdir()
    if setup == "not-empty":
        dest.mkdir()
        (dest / "old").write_text("old")
    elif setup == "link":
        dest.symlink_to(tmp_path / "real")
    elif setup == "file":
        dest.write_text("x")
    else:
        dest = tmp_path / "missing" / "dest"
    result = plugin(cluster, "-n", namespace, "cp", "run-42:logs", str(dest))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and said in result.stderr
    assert result.stderr.startswith("error: ")
    assert sessions(client, namespace) == [] and list((tmp_path / "real").iterdir()) == []


def test_cp_merge_adds_to_a_dest_and_never_overwrites(cluster, namespace, client, tmp_path):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    dest = tmp_path / "dest"
    (dest / "logs").mkdir(parents=True)
    (dest / "logs" / "build.log").write_text("mine\n")
    (dest / "logs" / "linked").symlink_to(tmp_path / "outside")
    archive = tar_of(
        tmp_path / "out.tar",
        [
            (member("logs/build.log"), b"theirs\n"),
            (member("logs/linked/x"), b"theirs\n"),
            (member("logs/new.log"), b"new\n"),
        ],
    )
    _session, code, _out, err = run_until_running(
        cluster, client, namespace, ["cp", "--merge", "run-42:logs", str(dest)], fake_kubectl(tmp_path, tar=archive)
    )
    assert code == 1
    assert "warning: refused to unpack 'logs/build.log': 'logs/build.log' already exists in DEST" in err
    assert "warning: refused to unpack 'logs/linked/x': 'logs/linked' is a symbolic link in DEST" in err
    assert (
        err.strip().splitlines()[-1] == f"error: refused 2 entries of logs (see the warnings above); copied 1 to {dest}"
    )
    assert (dest / "logs" / "build.log").read_text() == "mine\n" and (dest / "logs" / "new.log").read_text() == "new\n"
    assert not (tmp_path / "outside").exists()
    assert sessions(client, namespace) == []


def test_cp_of_a_cut_stream_is_one_error_line(cluster, namespace, client, tmp_path):
    make(client, namespace, "run-42", status={"phase": "Retained"})
    archive = tar_of(tmp_path / "out.tar", [(member("big.log"), b"x" * 2000)])
    archive.write_bytes(archive.read_bytes()[:1024])
    dest = tmp_path / "dest"
    _session, code, _out, err = run_until_running(
        cluster, client, namespace, ["cp", "run-42:logs", str(dest)], fake_kubectl(tmp_path, tar=archive)
    )
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: copying logs to {dest} stopped: the tar stream ends inside the data of 'big.log': it was cut short"
    )
    assert sessions(client, namespace) == []
