"""End to end on a real node: the chart's Pods, run by a real kubelet and containerd from the image the
Dockerfile builds, keep, pin, hold and delete real workspaces, and a real Prometheus pages on a stuck
tombstone. The bed (tests/bed/e2e_bed.py) is started once for this module; the tests run in file order and
each one's story stands on its own sandboxes.

A Job retains its workspace the way the README tells users to (`sandkeep retain` on the node, from the
image's console script); everything after that happens through the API and the chart's own Pods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.rules import contracts as c
from tests.bed.e2e_bed import SYSTEM_NS, UNPULLABLE_IMAGE, Bed, eventually, make_bed, say, started

# The first test also pays for the bed: on a fresh machine that includes the image's cold build (a Debian
# base made with mmdebstrap, then the pip install), minutes more than the suite's default timeout.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("e2e"), pytest.mark.timeout(1200)]
NS = "e2e"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with started(make_bed(tmp_path_factory.mktemp("e2e")), NS) as bed:
        yield bed


def pod_spec(bed: Bed, script: str, *, working_dir: str | None = None) -> dict[str, Any]:
    """A root container of the sandkeep image running `script`, with the node's disk at the same path."""
    container: dict[str, Any] = {
        "name": "main",
        "image": bed.image_ref,
        "command": ["sh", "-c", script],
        "securityContext": {"runAsUser": 0},
        "volumeMounts": [{"name": "disk", "mountPath": str(bed.disk)}],
    }
    if working_dir:
        container["workingDir"] = working_dir
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        "volumes": [{"name": "disk", "hostPath": {"path": str(bed.disk), "type": "Directory"}}],
    }


def run_job(bed: Bed, name: str, script: str, timeout: int = 120) -> None:
    """A Job on the node; waits for it to succeed (for `timeout` seconds)."""
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_spec(bed, script)}},
    }
    bed.kubectl("apply", "-f", "-", input=json.dumps(job))
    bed.kubectl(
        "wait", "-n", NS, f"job/{name}", "--for=condition=Complete", f"--timeout={timeout}s", timeout=timeout + 10
    )


def retain_job(bed: Bed, name: str, retention: str, files: int = 3, owner: int | None = None) -> Path:
    """A Job that writes a workspace on the node (owned by `owner`) and retains it; the sandbox's directory."""
    work = bed.disk / "jobs" / name
    chown = f"chown -R {owner}:{owner} {work}; " if owner is not None else ""
    script = (
        f"set -e; mkdir -p {work}/logs; echo 'build ok' > {work}/logs/result.txt; "
        f'python -c \'import sys; [open(f"{work}/f%d" % i, "w").close() for i in range({files})]\'; {chown}'
        f"sandkeep retain --root {bed.root} --namespace {NS} --name {name} --retention {retention} {work}"
    )
    say(f"Job job-{name} writes a workspace on {bed.node_name} and runs: sandkeep retain ... --retention {retention}")
    run_job(bed, f"job-{name}", script)
    return bed.root / NS / name


def hostpath_holder(bed: Bed, name: str, workspace: Path) -> dict[str, Any]:
    """A Pod that sleeps with `workspace` mounted by hostPath (what holds a sandbox from deletion)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            **pod_spec(bed, "sleep 3600"),
            "volumes": [{"name": "disk", "hostPath": {"path": str(workspace), "type": "Directory"}}],
        },
    }


def rsb(bed: Bed, name: str) -> dict[str, Any] | None:
    return bed.sandbox(NS, name)


def phase(bed: Bed, name: str) -> str | None:
    return bed.phase(NS, name)


def gone(bed: Bed, name: str, path: Path) -> bool:
    return rsb(bed, name) is None and not bed.exists(path) and not bed.tombstones()


def test_the_charts_pods_run_ready_from_the_built_image(bed: Bed) -> None:
    def ready() -> bool:
        deploy = bed.get("deployment", "-n", SYSTEM_NS, "sandkeep-controller")
        ds = bed.get("daemonset", "-n", SYSTEM_NS, "sandkeep-agent")
        return deploy["status"].get("readyReplicas") == 2 and ds["status"].get("numberReady") == 1

    eventually(ready, "2 controller replicas and 1 agent Ready", timeout=180)
    pods = bed.get("pods", "-n", SYSTEM_NS)["items"]
    images = {ct["image"] for p in pods for ct in p["spec"]["containers"]}
    assert images == {bed.image_ref}
    # Each component reached the API server with its own mounted ServiceAccount token: the agent's
    # heartbeat Lease and the controller's leader Lease are held by these Pods.
    names = {p["metadata"]["name"] for p in pods}
    leader = eventually(
        lambda: bed.get("lease", "-n", SYSTEM_NS, "sandkeep-controller")["spec"].get("holderIdentity"),
        "a controller leader",
    )
    assert leader.split("_")[0] in names
    leases = bed.get("leases", "-n", SYSTEM_NS)["items"]
    assert any(lease["metadata"]["name"] != "sandkeep-controller" for lease in leases), "no agent heartbeat Lease"
    # Prometheus scrapes both through the chart's own monitors.
    eventually(
        lambda: bed.targets_up() == {"sandkeep-controller": 2, "sandkeep-agent": 1},
        "Prometheus scraping 2 controllers and 1 agent",
        timeout=60,
    )


# Run in the agent's container and, as a control, in a Pod with the same capability under the runtime's
# default profile: ptrace (PTRACE_SEIZE, which never stops the tracee) and process_vm_readv of its own
# child, and the open files of a process of another user (a controller, uid 65532), which takes the
# kernel's ptrace *access check* that CAP_SYS_PTRACE passes. Prints the errno of each call (0: it worked).
# What the profile cannot refuse (the chart README says so): that same access check also opens another
# user's /proc/<pid>/mem and, through /proc/1/root, the node's own files.
PTRACE_PROBE = r"""
import ctypes, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return 0 if result != -1 else ctypes.get_errno()
def uid(pid):
    return next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("Uid:"))
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
child = subprocess.Popen(["sleep", "60"])
start = int(open(f"/proc/{child.pid}/maps").readline().split("-")[0], 16)
buf = ctypes.create_string_buffer(8)
local, remote = Iovec(ctypes.cast(buf, ctypes.c_void_p), 8), Iovec(start, 8)
other = next(p for p in os.listdir("/proc") if p.isdigit() and uid(p) == 65532)
print(json.dumps({
    "ptrace": errno_of(libc.ptrace(0x4206, child.pid, 0, 0)),
    "process_vm_readv": errno_of(libc.process_vm_readv(child.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)),
    "fds_of_another_user": len(os.listdir(f"/proc/{other}/fd")),
    "memory_of_another_user": len(os.pread(os.open(f"/proc/{other}/mem", os.O_RDONLY), 8, int(
        open(f"/proc/{other}/maps").readline().split("-")[0], 16))),
    "node_files": os.path.isdir("/proc/1/root/var/lib/kubelet"),
}))
child.kill()
"""


def test_the_agent_runs_under_its_seccomp_profile_which_refuses_ptrace_but_not_reading_proc(bed: Bed) -> None:
    agent = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"][0]
    profile = agent["spec"]["containers"][0]["securityContext"]["seccompProfile"]
    assert profile == {"type": "Localhost", "localhostProfile": "sandkeep/sandkeep-agent.json"}
    # On the node, outside any container: the agent's own process is filtered (mode 2) with no new privileges.
    script = (
        "for p in /proc/[0-9]*; do [ $p = /proc/$$ ] && continue; case \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" in "
        f"*' agent --node='*'--root={bed.root} '*) grep -E '^(Seccomp|NoNewPrivs):' $p/status;; esac; done"
    )
    status = bed.on_node(script).stdout.split()
    say(f"the agent's process on the node: {' '.join(status)}")
    assert status == ["NoNewPrivs:", "1", "Seccomp:", "2"], status
    exec_probe = ("exec", "-n", SYSTEM_NS, agent["metadata"]["name"], "-c", "agent", "--", "python", "-c")
    inside = json.loads(bed.kubectl(*exec_probe, PTRACE_PROBE).stdout)
    say(f"inside the agent's container: {inside}")
    assert inside["ptrace"] == inside["process_vm_readv"] == 1, "EPERM from the profile"
    assert inside["fds_of_another_user"] > 0, "the agent still reads other users' /proc/<pid>/fd"
    assert inside["memory_of_another_user"] == 8 and inside["node_files"], "what the chart README says remains"
    # The same calls in a Pod with the same capability under the runtime's default profile: they work.
    control = pod_spec(bed, "")
    control["containers"][0] |= {
        "command": ["python", "-c", PTRACE_PROBE],
        "securityContext": {"runAsUser": 0, "capabilities": {"add": ["SYS_PTRACE"]}},
    }
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ptrace-control", "namespace": NS}}
    bed.kubectl("apply", "-f", "-", input=json.dumps(pod | {"spec": control | {"hostPID": True}}))
    bed.kubectl("wait", "-n", NS, "pod/ptrace-control", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=90s")
    outside = json.loads(bed.kubectl("logs", "-n", NS, "ptrace-control").stdout)
    say(f"in a Pod with SYS_PTRACE under RuntimeDefault: {outside}")
    assert outside["ptrace"] == outside["process_vm_readv"] == 0 and outside["fds_of_another_user"] > 0


def test_a_jobs_workspace_is_retained_on_the_node_and_adopted(bed: Bed) -> None:
    path = retain_job(bed, "run-1", "1h")
    obj = eventually(lambda: (o := rsb(bed, "run-1")) and o.get("status", {}).get("sizeBytes") and o, "adoption")
    assert obj["spec"]["nodeName"] == bed.node_name
    assert bed.on_node(f"cat '{path}/workspace/logs/result.txt'").stdout == "build ok\n"
    assert obj["status"]["phase"] == "Retained"


def test_a_pin_keeps_a_sandbox_past_its_deadline_and_unpinning_releases_it(bed: Bed) -> None:
    path = retain_job(bed, "run-2", "20s")
    eventually(lambda: rsb(bed, "run-2"), "adoption")
    say("kubectl annotate rsb/run-2 sandkeep.io/pin-for=1h, then wait past its 20 s")
    bed.kubectl("annotate", "rsb/run-2", "-n", NS, f"{c.ANN_PIN_FOR}=1h")
    eventually(lambda: phase(bed, "run-2") == "Pinned", "the pin")
    time.sleep(25)  # past the 20 s it was retained for
    assert phase(bed, "run-2") == "Pinned" and bed.exists(path)
    say("unpin: kubectl annotate rsb/run-2 sandkeep.io/pin-until-")
    bed.kubectl("annotate", "rsb/run-2", "-n", NS, f"{c.ANN_PIN_UNTIL}-")
    eventually(lambda: gone(bed, "run-2", path), "the unpinned, expired sandbox deleted from the node", timeout=60)


def test_a_pods_hostpath_and_a_containers_cwd_each_hold_a_sandbox(bed: Bed) -> None:
    path = retain_job(bed, "run-3", "20s")
    eventually(lambda: rsb(bed, "run-3"), "adoption")
    workspace = path / "workspace"
    mount_holder = hostpath_holder(bed, "holder-mount", workspace)
    # This one mounts the whole disk (not the sandbox), so only its process's cwd, seen by the agent
    # through the host PID namespace, ties it to the sandbox.
    cwd_holder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "holder-cwd", "namespace": NS},
        "spec": pod_spec(bed, "sleep 3600", working_dir=str(workspace / "logs")),
    }
    say("Pod holder-mount mounts run-3's workspace; Pod holder-cwd only has its working directory in it")
    for pod in (mount_holder, cwd_holder):
        bed.kubectl("apply", "-f", "-", input=json.dumps(pod))
    bed.kubectl("wait", "-n", NS, "pod/holder-mount", "pod/holder-cwd", "--for=condition=Ready", "--timeout=90s")
    eventually(lambda: phase(bed, "run-3") == "Held", "the expired sandbox held by both", timeout=60)
    say("delete holder-mount: the cwd alone must still hold run-3")
    bed.kubectl("delete", "pod", "holder-mount", "-n", NS, "--wait=true")
    time.sleep(8)  # several agent passes
    obj = rsb(bed, "run-3")
    assert obj is not None and obj["status"]["phase"] == "Held" and bed.exists(path), "the cwd alone must hold it"
    in_use = next(x for x in obj["status"]["conditions"] if x["type"] == "InUse")
    assert in_use["status"] == "True"
    say("delete holder-cwd: nothing holds run-3 any more")
    bed.kubectl("delete", "pod", "holder-cwd", "-n", NS, "--wait=true")
    eventually(lambda: gone(bed, "run-3", path), "the released sandbox deleted", timeout=60)


def test_a_stuck_tombstone_pages_through_prometheus_until_it_is_fixed(bed: Bed) -> None:
    path = retain_job(bed, "run-4", "10s")
    eventually(lambda: rsb(bed, "run-4"), "adoption")
    say("chattr +i one file of run-4: its tombstone cannot be deleted")
    bed.on_node(f"chattr +i '{path}/workspace/f0'")
    try:
        eventually(lambda: phase(bed, "run-4") == "Stuck", "the tombstone reported stuck", timeout=90)
        alert = eventually(
            lambda: [a for a in bed.alerts("SandkeepTombstoneStuck") if a["state"] == "firing"],
            "SandkeepTombstoneStuck firing in Prometheus",
            timeout=150,
            every=5,
        )
        assert alert[0]["labels"]["node"] == bed.node_name
    finally:
        say("chattr -i: the tombstone can go")
        bed.on_node(f"chattr -R -i '{bed.root}'", check=False)
    eventually(lambda: gone(bed, "run-4", path), "the fixed tombstone deleted", timeout=60)
    eventually(lambda: not bed.alerts("SandkeepTombstoneStuck"), "the alert resolved", timeout=90, every=5)


def test_killing_the_agent_mid_delete_and_the_leader_loses_nothing(bed: Bed) -> None:
    path = retain_job(bed, "run-5", "15s", files=40000)
    eventually(lambda: rsb(bed, "run-5"), "adoption", timeout=120)
    agent = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"][0]
    eventually(bed.tombstones, "the delete under way (a tombstone)", timeout=60, every=0.2)
    say(f"kubectl delete pod {agent['metadata']['name']} while it deletes run-5's 40,000 files")
    bed.kubectl("delete", "pod", agent["metadata"]["name"], "-n", SYSTEM_NS, "--wait=false")
    eventually(lambda: gone(bed, "run-5", path), "the delete finished by the next agent", timeout=180)

    leader = bed.get("lease", "-n", SYSTEM_NS, "sandkeep-controller")["spec"]["holderIdentity"].split("_")[0]
    path6 = retain_job(bed, "run-6", "20s")
    say(f"kubectl delete pod {leader} (the leader controller) before run-6 expires")
    bed.kubectl("delete", "pod", leader, "-n", SYSTEM_NS, "--wait=false")
    eventually(lambda: gone(bed, "run-6", path6), "the expiry acted on by the other replica", timeout=120)
    holder = bed.get("lease", "-n", SYSTEM_NS, "sandkeep-controller")["spec"]["holderIdentity"]
    assert holder.split("_")[0] != leader


def create_session(bed: Bed, sandbox: str, user: str | None = None, *, as_user: str | None = None, **spec: Any) -> None:
    """Create SandboxSession `look-<sandbox>` as `as_user` (admin: None) for `user` (admin's own: None)."""
    if user is None:
        user = bed.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout
    body = {
        "apiVersion": c.API_VERSION,
        "kind": c.SESSION_KIND,
        "metadata": {"name": f"look-{sandbox}", "namespace": NS},
        "spec": {"sandbox": sandbox, "user": user, **spec},
    }
    impersonate = [f"--as={as_user}"] if as_user else []
    bed.kubectl(*impersonate, "create", "-f", "-", input=json.dumps(body))


def open_session(bed: Bed, sandbox: str, user: str, *, as_user: str | None = None, **spec: Any) -> dict[str, Any]:
    """Create a SandboxSession as `as_user` (admin: None) and wait until it runs; its status."""
    create_session(bed, sandbox, user, as_user=as_user, **spec)

    def running() -> dict[str, Any] | None:
        status = bed.get(c.SESSION_PLURAL, f"look-{sandbox}", "-n", NS).get("status") or {}
        assert status.get("phase") not in (c.SessionPhase.REFUSED, c.SessionPhase.ENDED), status
        return status if status.get("phase") == c.SessionPhase.RUNNING else None

    return eventually(running, f"session look-{sandbox} Running", timeout=120)


def test_a_session_opens_a_retained_sandbox_read_only_for_its_user_alone(bed: Bed) -> None:
    path = retain_job(bed, "run-9", "1h", owner=1234)
    eventually(lambda: (rsb(bed, "run-9") or {}).get("status", {}).get("owner"), "adoption and the owner read")
    alice = "alice@example.com"
    bed.kubectl("create", "rolebinding", "alice-edits", "--clusterrole=edit", f"--user={alice}", "-n", NS)
    say(f"{alice} (edit in {NS}) opens run-9: a Pod in {NS} on {bed.node_name}, the sandbox at /sandbox by CSI")
    status = open_session(bed, "run-9", alice, as_user=alice)
    pod, pod_ns = status["podName"], status["podNamespace"]
    assert pod_ns == NS, "a session's Pod runs in the sandbox's own namespace"
    as_alice = (f"--as={alice}", "exec", "-n", pod_ns, pod, "-c", c.SESSION_CONTAINER, "--")
    assert bed.kubectl(*as_alice, "cat", "/sandbox/logs/result.txt").stdout == "build ok\n"
    assert bed.kubectl(*as_alice, "id", "-u").stdout == "1234\n", "a session runs as the workspace's owner"
    refused = bed.kubectl(*as_alice, "touch", "/sandbox/new-file", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    assert not bed.exists(path / "workspace" / "new-file")
    bob = ("--as=bob@example.com", "exec", "-n", pod_ns, pod, "-c", c.SESSION_CONTAINER, "--", "true")
    assert "forbidden" in bed.kubectl(*bob, check=False).stderr, "exec is the user's own pods/exec: bob has none"
    eventually(lambda: any(pod in h for h in (rsb(bed, "run-9") or {}).get("status", {}).get("heldBy", [])), "the hold")
    say("end the session: its Pod goes, and nothing holds run-9 any more")
    bed.kubectl("delete", c.SESSION_PLURAL, "look-run-9", "-n", NS)
    eventually(lambda: bed.kubectl("get", "pod", pod, "-n", pod_ns, check=False).returncode != 0, "the Pod gone")
    assert bed.kubectl("get", "rolebindings", "-n", pod_ns, "-o", "name").stdout.count("/session-") == 0
    eventually(lambda: phase(bed, "run-9") == c.Phase.RETAINED, "run-9 Retained again once the session ended")
    assert bed.exists(path)
    say("a read-write session: the owner's uid writes into the workspace")
    rw = open_session(bed, "run-9", alice, as_user=alice, readWrite=True, lifetime="10m")
    as_owner = (f"--as={alice}", "exec", "-n", rw["podNamespace"], rw["podName"], "-c", c.SESSION_CONTAINER, "--")
    bed.kubectl(*as_owner, "sh", "-c", "echo notes > /sandbox/notes.txt")
    assert bed.on_node(f"stat -c %u '{path}/workspace/notes.txt'").stdout == "1234\n"
    bed.kubectl("delete", c.SESSION_PLURAL, "look-run-9", "-n", NS)


def kubectl_sandkeep(bed: Bed, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl sandkeep ...` as a person runs it: the real kubectl finds the plugin on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{bed.bin}:{os.environ['PATH']}"}
    command = [str(bed.bin / "kubectl"), "sandkeep", f"--kubeconfig={bed.kubeconfig}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)


def test_kubectl_sandkeep_open_and_cp_read_a_retained_sandbox(bed: Bed, tmp_path: Path) -> None:
    retain_job(bed, "run-11", "1h")
    eventually(lambda: rsb(bed, "run-11"), "adoption")
    say("kubectl sandkeep open run-11 -- cat logs/result.txt")
    opened = kubectl_sandkeep(bed, "open", "run-11", "-n", NS, "--", "cat", "logs/result.txt")
    assert (opened.returncode, opened.stdout) == (0, "build ok\n"), opened.stderr
    written = kubectl_sandkeep(bed, "open", "run-11", "-n", NS, "--", "touch", "new-file")
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    say("a root-owned workspace opened by the session's non-root user: the files' modes decide what it reads")
    bed.on_node(f"umask 077 && echo secret > '{bed.root / NS / 'run-11' / c.WORKSPACE_DIR}/root-only'")
    denied = kubectl_sandkeep(bed, "open", "run-11", "-n", NS, "--", "cat", "root-only")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied.stderr
    assert "owned by root and the session is not root" in denied.stderr
    say("kubectl sandkeep cp run-11:logs DEST")
    copied = kubectl_sandkeep(bed, "cp", "run-11:logs", str(tmp_path / "out"), "-n", NS)
    assert copied.returncode == 0, copied.stderr
    assert (tmp_path / "out" / "logs" / "result.txt").read_text() == "build ok\n"
    assert bed.get(c.SESSION_PLURAL, "-n", NS)["items"] == [], "each session ended on exit"


def test_a_session_with_an_image_that_cannot_be_pulled_ends_saying_so(bed: Bed) -> None:
    retain_job(bed, "run-10", "1h")
    eventually(lambda: rsb(bed, "run-10"), "adoption")
    create_session(bed, "run-10", image=UNPULLABLE_IMAGE)

    def ended() -> dict[str, Any] | None:
        status = bed.get(c.SESSION_PLURAL, "look-run-10", "-n", NS).get("status") or {}
        return status if status.get("phase") == c.SessionPhase.ENDED else None

    status = eventually(ended, "the session ended", timeout=120)
    assert status["reason"] == c.Reason.IMAGE_PULL_FAILED and UNPULLABLE_IMAGE in status["message"]


RESTRICTED = "e2e-restricted"  # a tenant namespace enforcing Pod Security `restricted`: no hostPath, no root


def restricted_spec(bed: Bed, script: str, attributes: dict[str, str]) -> dict[str, Any]:
    """A Pod spec of the restricted namespace (which it creates once): non-root with an fsGroup, running `script`
    in /workspace, a csi volume of sandkeep's driver with `attributes`."""
    if bed.kubectl("get", "namespace", RESTRICTED, check=False).returncode != 0:
        bed.kubectl("create", "namespace", RESTRICTED)
        bed.kubectl("label", "namespace", RESTRICTED, "pod-security.kubernetes.io/enforce=restricted")
    container = {
        "name": "build",
        "image": bed.image_ref,
        "command": ["sh", "-c", script],
        "workingDir": "/workspace",
        "volumeMounts": [{"name": "workspace", "mountPath": "/workspace"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    volume = {"name": "workspace", "csi": {"driver": c.CSI_DRIVER, "volumeAttributes": attributes}}
    pod_security = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "nodeName": bed.node_name,
        "securityContext": pod_security | {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [volume],
    }


def start_capture_job(bed: Bed, name: str, script: str, keep: str) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": RESTRICTED},
        "spec": {"backoffLimit": 0, "template": {"spec": restricted_spec(bed, script, {c.VOLUME_KEEP: keep})}},
    }
    say(f"Job {name} in {RESTRICTED} (Pod Security restricted, uid 1000): a csi volume with keep: {keep}")
    bed.kubectl("apply", "-f", "-", input=json.dumps(job))


def job_pod(bed: Bed, name: str) -> dict[str, Any] | None:
    pods = bed.get("pods", "-n", RESTRICTED, "-l", f"job-name={name}")["items"]
    return pods[0] if pods else None


def capture_job(bed: Bed, name: str, script: str, keep: str) -> dict[str, Any]:
    """A Job of the restricted namespace whose workspace is a csi volume with `keep`; waits for it to end and
    returns its Pod (as the API last served it)."""
    start_capture_job(bed, name, script, keep)

    def ended() -> dict[str, Any] | None:
        pod = job_pod(bed, name)
        return pod if pod and pod["status"].get("phase") in ("Succeeded", "Failed") else None

    return eventually(ended, f"{name}'s Pod ended", timeout=180)


def kept_sandbox(bed: Bed, pod: dict[str, Any]) -> dict[str, Any] | None:
    """The RetainedSandbox kept from this Pod's workspace, by its recorded origin."""
    for obj in bed.get(c.SANDBOX_PLURAL, "-n", RESTRICTED)["items"]:
        if (obj["spec"].get("origin") or {}).get("podUID") == pod["metadata"]["uid"]:
            return obj
    return None


def pod_events(bed: Bed, pod: dict[str, Any]) -> list[dict[str, Any]]:
    name = pod["metadata"]["name"]
    selector = f"involvedObject.name={name},involvedObject.kind=Pod"
    return bed.get("events", "-n", RESTRICTED, f"--field-selector={selector}")["items"]


def test_a_restricted_non_root_job_that_fails_keeps_its_workspace_through_the_csi_volume(bed: Bed) -> None:
    script = "mkdir logs && echo 'tests failed' > logs/result.txt && id -u > uid && exit 3"
    pod = capture_job(bed, "build-fails", script, "OnFailure")
    obj = eventually(lambda: kept_sandbox(bed, pod), "the failed Pod's workspace kept as a RetainedSandbox", 120)
    origin = obj["spec"]["origin"]
    say(f"kept as {RESTRICTED}/{obj['metadata']['name']}: outcome {origin['outcome']}")
    assert origin["outcome"] == c.Outcome.FAILED and obj["spec"]["nodeName"] == bed.node_name
    assert origin["owner"] == {"kind": "Job", "name": "build-fails"} and origin["containers"][0]["exitCode"] == 3
    work = bed.root / RESTRICTED / obj["metadata"]["name"] / c.WORKSPACE_DIR
    assert bed.on_node(f"cat '{work}/logs/result.txt' '{work}/uid'").stdout == "tests failed\n1000\n"
    assert bed.on_node(f"stat -c %u:%g '{work}/logs/result.txt'").stdout == "1000:2000\n", "the Pod's uid, its fsGroup"
    reasons = {e["reason"] for e in pod_events(bed, pod)}
    assert c.Reason.WORKSPACE_KEPT in reasons, reasons
    printed = bed.kubectl("get", c.SANDBOX_PLURAL, obj["metadata"]["name"], "-n", RESTRICTED).stdout
    assert "OUTCOME" in printed and "Failed" in printed, printed


def test_the_same_job_succeeding_with_keep_on_failure_keeps_nothing_and_says_so(bed: Bed) -> None:
    pod = capture_job(bed, "build-passes", "echo ok > result.txt", "OnFailure")

    def said() -> list[dict[str, Any]] | None:
        events = [e for e in pod_events(bed, pod) if e["reason"] == c.Reason.WORKSPACE_NOT_KEPT]
        return events or None

    (event,) = eventually(said, "a WorkspaceNotKept Event on the Pod", timeout=120)
    say(f"Event on {pod['metadata']['name']}: {event['message']}")
    assert "Succeeded" in event["message"] and "OnFailure" in event["message"]
    assert kept_sandbox(bed, pod) is None
    volumes = bed.root / c.VOLUMES_DIR  # other Pods' volumes may be live there: only this Pod's entry must go
    uid = pod["metadata"]["uid"]
    leftover = bed.on_node(f"grep -l '{uid}' '{volumes}'/*/record.json", check=False).stdout.split()
    assert leftover == [], "the workspace is deleted, its entry gone"


def test_a_pod_deleted_mid_run_keeps_its_workspace_as_unknown(bed: Bed) -> None:
    """A Pod deleted while it runs never reports how its job ended: Unknown, which fails closed (kept)."""
    capture_job(bed, "build-short", "true", "Always")  # the namespace, made the same way
    spec = bed.get("job", "build-short", "-n", RESTRICTED)["spec"]["template"]["spec"]
    spec["containers"][0]["command"] = ["sh", "-c", "echo half > half.txt && sleep 600"]
    spec["volumes"][0]["csi"]["volumeAttributes"] = {c.VOLUME_KEEP: "OnFailure", c.VOLUME_NAME: "interrupted"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runs-long", "namespace": RESTRICTED}, "spec": spec}
    bed.kubectl("apply", "-f", "-", input=json.dumps(pod))
    bed.kubectl("wait", "-n", RESTRICTED, "pod/runs-long", "--for=condition=Ready", "--timeout=120s", timeout=130)
    live = bed.get("pod", "runs-long", "-n", RESTRICTED)
    say("kubectl delete pod runs-long while it runs: its volume is unpublished, its outcome never known")
    bed.kubectl("delete", "pod", "runs-long", "-n", RESTRICTED, "--wait=true", timeout=90)
    obj = eventually(lambda: kept_sandbox(bed, live), "the interrupted workspace kept", timeout=180)
    assert obj["metadata"]["name"] == "interrupted" and obj["spec"]["origin"]["outcome"] == c.Outcome.UNKNOWN
    work = bed.root / RESTRICTED / "interrupted" / c.WORKSPACE_DIR
    assert bed.on_node(f"cat '{work}/half.txt'").stdout == "half\n"


def kept_once(bed: Bed, pod: dict[str, Any]) -> dict[str, Any] | None:
    """The one RetainedSandbox kept from this Pod's workspace, once its entry is gone; None until then.
    Fails if there are two: a workspace is kept exactly once."""
    uid = pod["metadata"]["uid"]
    kept = [
        o
        for o in bed.get(c.SANDBOX_PLURAL, "-n", RESTRICTED)["items"]
        if o["spec"].get("origin", {}).get("podUID") == uid
    ]
    assert len(kept) <= 1, [o["metadata"]["name"] for o in kept]
    entries = bed.on_node(f"grep -l '{uid}' '{bed.root / c.VOLUMES_DIR}'/*/record.json", check=False).stdout.split()
    return kept[0] if kept and not entries else None


def agent_pod(bed: Bed) -> str:
    (pod,) = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"]
    return str(pod["metadata"]["name"])


def test_the_agent_pod_killed_as_a_jobs_volume_is_unpublished_keeps_the_workspace_exactly_once(bed: Bed) -> None:
    start_capture_job(bed, "build-killed", "echo partial > out.txt && sleep 3 && exit 1", "OnFailure")

    def container_ended() -> dict[str, Any] | None:
        pod = job_pod(bed, "build-killed")
        statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
        return pod if statuses and "terminated" in statuses[0]["state"] else None

    pod = eventually(container_ended, "the job's container ended (its volume is being unpublished)", 120, every=0.1)
    agent = agent_pod(bed)
    say(f"kubectl delete pod {agent} --grace-period=0 --force, as the kubelet unpublishes build-killed's volume")
    bed.kubectl("delete", "pod", agent, "-n", SYSTEM_NS, "--grace-period=0", "--force", "--wait=false")
    obj = eventually(lambda: kept_once(bed, pod), "the workspace kept once, by the next agent", timeout=300)
    say(f"kept as {RESTRICTED}/{obj['metadata']['name']}: outcome {obj['spec']['origin']['outcome']}, exactly once")
    assert obj["spec"]["origin"]["outcome"] == c.Outcome.FAILED
    work = bed.root / RESTRICTED / obj["metadata"]["name"] / c.WORKSPACE_DIR
    assert bed.on_node(f"cat '{work}/out.txt'").stdout == "partial\n"
    assert agent_pod(bed) != agent


def test_the_kubelet_stopped_and_the_pod_force_deleted_keeps_the_workspace_by_recovery(bed: Bed) -> None:
    attributes = {c.VOLUME_KEEP: "OnFailure", c.VOLUME_NAME: "outlived-kubelet"}
    spec = restricted_spec(bed, "echo before > before.txt && sleep 600", attributes)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "outlives", "namespace": RESTRICTED}, "spec": spec}
    bed.kubectl("apply", "-f", "-", input=json.dumps(pod))
    bed.kubectl("wait", "-n", RESTRICTED, "pod/outlives", "--for=condition=Ready", "--timeout=120s", timeout=130)
    live = bed.get("pod", "outlives", "-n", RESTRICTED)
    say("stop the kubelet (its containers keep running), force-delete the Pod, start the kubelet again")
    bed.stop_kubelet()
    try:
        bed.kubectl("delete", "pod", "outlives", "-n", RESTRICTED, "--grace-period=0", "--force")
    finally:
        bed.start_kubelet()
    obj = eventually(lambda: kept_once(bed, live), "the workspace kept once its Pod was found gone", timeout=300)
    say(f"kept as {RESTRICTED}/{obj['metadata']['name']}: outcome {obj['spec']['origin']['outcome']}")
    assert obj["metadata"]["name"] == "outlived-kubelet" and obj["spec"]["origin"]["outcome"] == c.Outcome.UNKNOWN
    work = bed.root / RESTRICTED / "outlived-kubelet" / c.WORKSPACE_DIR
    assert bed.on_node(f"cat '{work}/before.txt'").stdout == "before\n"


def test_reopen_refusals_reach_the_pods_events_and_mount_nothing(bed: Bed) -> None:
    hold = {"metadata": {"finalizers": ["e2e.sandkeep.io/hold"]}}  # keeps the object while it is being deleted
    bed.kubectl("patch", c.SANDBOX_PLURAL, "outlived-kubelet", "-n", RESTRICTED, "--type=merge", "-p", json.dumps(hold))
    bed.kubectl("delete", c.SANDBOX_PLURAL, "outlived-kubelet", "-n", RESTRICTED, "--wait=false")
    cases = {
        "reopen-theirs": ("run-11", f"RetainedSandbox {RESTRICTED}/run-11 does not exist"),  # it is in {NS}
        "reopen-deleting": ("outlived-kubelet", "is being deleted; a deletion is final"),
    }
    for name, (sandbox, _) in cases.items():
        spec = restricted_spec(bed, "cat /workspace/logs/result.txt; sleep 60", {c.VOLUME_SANDBOX: sandbox})
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": RESTRICTED}, "spec": spec}
        say(f"Pod {RESTRICTED}/{name} mounts sandbox {sandbox} through the CSI driver")
        bed.kubectl("apply", "-f", "-", input=json.dumps(body))
    try:
        for name, (_, said) in cases.items():
            pod = bed.get("pod", name, "-n", RESTRICTED)

            def refused(pod: dict[str, Any] = pod, said: str = said) -> str | None:
                texts = [e["message"] for e in pod_events(bed, pod) if e["reason"] == "FailedMount"]
                return next((t for t in texts if said in t), None)

            say(f"{name}'s Event: {eventually(refused, f'{name} refused in its Events', timeout=120)}")
            assert bed.get("pod", name, "-n", RESTRICTED)["status"].get("phase") == "Pending"
            uid = pod["metadata"]["uid"]
            volumes = bed.root / c.VOLUMES_DIR
            assert bed.on_node(f"grep -l '{uid}' '{volumes}'/*/record.json", check=False).stdout == ""
    finally:
        bed.kubectl("delete", "pod", *cases, "-n", RESTRICTED, "--grace-period=0", "--force", check=False)
        obj = bed.get(c.SANDBOX_PLURAL, "outlived-kubelet", "-n", RESTRICTED)
        left = [f for f in obj["metadata"].get("finalizers", []) if f != "e2e.sandkeep.io/hold"]  # the agent's stay
        release = {"metadata": {"finalizers": left, "resourceVersion": obj["metadata"]["resourceVersion"]}}
        bed.kubectl(
            "patch", c.SANDBOX_PLURAL, "outlived-kubelet", "-n", RESTRICTED, "--type=merge", "-p", json.dumps(release)
        )


def test_open_as_job_reopens_the_failed_workspace_where_and_as_the_job_had_it(bed: Bed) -> None:
    pod = job_pod(bed, "build-fails")
    assert pod is not None
    obj = kept_sandbox(bed, pod)
    assert obj is not None
    name, script = obj["metadata"]["name"], "pwd; cat logs/result.txt; id -u"
    say(f"kubectl sandkeep open {name} -n {RESTRICTED} --as-job -- sh -c '{script}'")
    opened = kubectl_sandkeep(bed, "open", name, "-n", RESTRICTED, "--as-job", "--", "sh", "-c", script)
    assert (opened.returncode, opened.stdout) == (0, "/workspace\ntests failed\n1000\n"), opened.stderr
    say(f"it printed {opened.stdout!r}: the job's directory, its file, its uid")
    assert f"at /workspace in {bed.image_ref}; the job ran as uid 1000" in opened.stderr


def test_a_tenants_pods_0_quota_refuses_its_session_on_the_real_node(bed: Bed) -> None:
    pod = job_pod(bed, "build-fails")
    obj = kept_sandbox(bed, pod or {"metadata": {"uid": ""}})
    assert obj is not None
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods", "namespace": RESTRICTED}}
    quota["spec"] = {"hard": {"pods": "0"}}

    def session_pods() -> set[str]:
        return set(bed.kubectl("get", "pods", "-n", RESTRICTED, "-l", c.LABEL_SESSION_UID, "-o", "name").stdout.split())

    before = session_pods()  # an earlier test's session Pod may still be terminating
    bed.kubectl("apply", "-f", "-", input=json.dumps(quota))
    try:

        def counted() -> object:
            return (bed.get("resourcequota", "no-pods", "-n", RESTRICTED).get("status") or {}).get("hard")

        eventually(counted, "the quota counted by the resource quota controller")
        say(f"ResourceQuota pods: 0 in {RESTRICTED}; kubectl sandkeep open {obj['metadata']['name']}")
        opened = kubectl_sandkeep(bed, "open", obj["metadata"]["name"], "-n", RESTRICTED, "--", "true")
        assert opened.returncode != 0 and "exceeded quota: no-pods" in opened.stderr, opened.stderr
        say(f"refused: {opened.stderr.strip().splitlines()[-1][:200]}")
        assert session_pods() <= before, "no session Pod was made"
    finally:
        bed.kubectl("delete", "resourcequota", "no-pods", "-n", RESTRICTED)


def test_helm_uninstall_stops_the_agents_and_strands_nothing(bed: Bed) -> None:
    """Last, since it removes the chart: the pre-delete hook Job runs `sandkeep uninstall` on the node, so the
    agents stop before their finalizer is removed; the sandbox's directory stays (uninstall.sandboxes=keep),
    its object and CRDs stay (crds.keep) and nothing is left Terminating: the namespace then deletes."""
    path = retain_job(bed, "run-last", "1h")
    eventually(
        lambda: c.FINALIZER in ((rsb(bed, "run-last") or {}).get("metadata") or {}).get("finalizers", []),
        "adoption with the agent's finalizer",
        timeout=120,
    )
    say(f"helm uninstall sandkeep -n {SYSTEM_NS}: the pre-delete hook stops the agents, then releases run-last")
    out = bed.helm("uninstall", "sandkeep", "-n", SYSTEM_NS, "--wait", "--timeout=5m")
    assert "uninstalled" in out, out
    assert bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"] == []
    kept = rsb(bed, "run-last")
    assert kept is not None and c.FINALIZER not in (kept["metadata"].get("finalizers") or [])
    assert bed.exists(path), "keep: the directory stays on the node for a reinstall to adopt"
    assert bed.get("crd", f"{c.SANDBOX_PLURAL}.{c.GROUP}")["metadata"]["name"]
    say(f"kubectl delete namespace {NS}: completes, nothing holds it")
    bed.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", timeout=130)
