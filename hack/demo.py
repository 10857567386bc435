"""`make demo`: the whole sandkeep story on a real local control plane, in about two minutes.

It starts etcd + kube-apiserver (hack/localcluster.py), installs the CRDs with the real kubectl, creates
two Node objects, and runs the controller and one agent per simulated node (each with its own root
directory) as real `sandkeep` processes. Then it retains real job workspaces with `sandkeep retain`, pins
one with `kubectl annotate`, keeps one in use with a live process, leaves an orphan command in one and
SIGKILLs its recorder (the orphans do not hold it: they are killed when it expires), makes one
undeletable with `chattr +i`, and shows what sandkeep does about each. Last, a third node whose disk is a
small tmpfs fills past its high watermark and its agent releases the oldest unpinned runs, the pinned one
surviving.

Every step checks its expected outcome with a timeout; the demo exits 1 (saying which step and why) if
one does not happen. Every process and directory it created is removed on exit, on Ctrl-C and on SIGTERM.
Needs root (chattr +i, mounting the tmpfs) and the built tools (`make tools`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from controller.api.kube import now_utc
from controller.node.inuse import uninspectable_pids
from controller.rules import contracts as c
from controller.rules.durations import Invalid, instant_or_none, parse_duration
from controller.rules.objects import condition_of
from hack.localcluster import CLUSTER_TOOLS, ClusterError, LocalCluster, tools_bin
from hack.processes import signals_raise, stop_group

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

NAMESPACE = "demo"
SYSTEM_NAMESPACE = "sandkeep-system"
IN_USE_COLUMNS = "jsonpath={.status.inUse} {.status.heldBy}"  # what `kubectl get rsb` shows of a hold
NODES = ("node-a", "node-b")
WINDOW = "40s"  # the demo namespace's retention window (a SandboxPolicy); real clusters use days
RECORDED = "20s"  # one sandbox records a shorter deadline of its own at retention (`retain --retention`)
SLOW_HINT = "this machine is too slow for the default windows: run again with DEMO_ARGS='--window 90s --recorded 45s'"
MANY_FILES = 3000
WIDTH = 100


class DemoFailed(Exception):
    """A step's expected outcome did not happen: the message says what was expected and what was seen."""


@dataclass
class Sandbox:
    """One job workspace of the story: where it lives, and what the demo expects sandkeep to do with it."""

    name: str
    node: str
    files: int = 3
    recorded: str | None = None  # `retain --retention`: a recorded deadline
    size: int = 0  # the last status.sizeBytes seen while it existed
    deleted: bool = False


@dataclass
class Proc:
    """A process the demo started: stopped by pid (its own process group) at the end."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path | None = None


@dataclass
class Demo:
    """The running story: what it started (to stop it by pid), where things are, and the narration."""

    workdir: Path
    cluster: LocalCluster
    sandkeep: list[str]
    started: float = field(default_factory=time.monotonic)
    step_no: int = 0
    procs: list[Proc] = field(default_factory=list)
    extra_pids: list[tuple[int, int]] = field(default_factory=list)  # (pid, start ticks) of orphans
    roots: dict[str, Path] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    immutable: list[Path] = field(default_factory=list)
    window: str = WINDOW
    recorded: str = RECORDED
    agent_args: list[str] = field(default_factory=list)  # what every agent gets: kubeconfig, namespace, timing
    mounts: list[Path] = field(default_factory=list)  # unmounted at the end

    # --- narration ---------------------------------------------------------------------------------------
    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:5.1f}s"

    def step(self, title: str, why: str) -> None:
        self.step_no += 1
        print(f"\n[{self.elapsed()}] Step {self.step_no}. {title}", flush=True)
        for line in _wrap(why):
            print(f"    {line}")

    def say(self, text: str) -> None:
        for line in _wrap(text) or [""]:
            print(f"    {line}", flush=True)

    def ok(self, text: str) -> None:
        print(f"    ok [{self.elapsed()}]: {text}", flush=True)

    def show(self, title: str, text: str, *, command: bool = True) -> None:
        """A command (`$ ...`) or a labelled excerpt (`# ...`) and its output, indented under the step."""
        print(f"    {'$' if command else '#'} {_short_paths(title, self)}")
        for line in _short_paths(text, self).rstrip("\n").splitlines():
            print(f"      {line}")
        sys.stdout.flush()

    # --- running things ----------------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True, show: bool = False) -> str:
        """The real kubectl against the demo's API server; `show` prints the command and its output."""
        result = self.cluster.kubectl(*args, check=check)
        if show:
            self.show("kubectl " + shlex.join(args), result.stdout + result.stderr)
        return result.stdout

    def run_sandkeep(self, *args: str, show: bool = True, ok_codes: Sequence[int] = (0,)) -> str:
        """A short `sandkeep` command (retain, doctor); its output shown, an unexpected exit code fails."""
        result = subprocess.run([*self.sandkeep, *args], capture_output=True, text=True, timeout=120)
        if show:
            self.show_sandkeep(args, result, ok_codes)
        elif result.returncode not in ok_codes:
            raise DemoFailed(f"`sandkeep {' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def run_many(self, commands: Sequence[Sequence[str]]) -> list[subprocess.CompletedProcess[str]]:
        """Several `sandkeep` commands at once (each a process of its own); their results in order."""
        started = [
            subprocess.Popen([*self.sandkeep, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in commands
        ]
        results = []
        for args, popen in zip(commands, started, strict=True):
            out, err = popen.communicate(timeout=120)
            results.append(subprocess.CompletedProcess(list(args), popen.returncode, out, err))
        return results

    def show_sandkeep(
        self, args: Sequence[str], result: subprocess.CompletedProcess[str], ok_codes: Sequence[int] = (0,)
    ) -> None:
        self.show("sandkeep " + _short_paths(" ".join(args), self), result.stdout + _noise_free(result.stderr))
        if result.returncode not in ok_codes:
            raise DemoFailed(f"`sandkeep {' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")

    def start(self, name: str, args: Sequence[str], log: Path | None = None, cwd: Path | None = None) -> Proc:
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        popen = subprocess.Popen(
            list(args), stdout=out, stderr=subprocess.STDOUT, cwd=cwd or REPO, start_new_session=True
        )
        if log is not None:
            assert not isinstance(out, int)
            out.close()  # the child holds its own copy of the descriptor
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Signal the group the process leads (only while it is unreaped, so the pid is still ours)."""
        stop_group(proc.popen, sig, timeout)

    def wait(self, what: str, check: Callable[[], T | None], timeout: float = 60.0, every: float = 0.25) -> T:
        """Poll `check` until it returns something truthy; DemoFailed naming `what` when the time runs out."""
        limit = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            for proc in self.procs:
                if proc.name.startswith(("agent", "controller")) and proc.popen.poll() is not None:
                    raise DemoFailed(f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}")
            if time.monotonic() > limit:
                raise DemoFailed(f"expected {what} within {timeout:.0f}s, but it did not happen")
            time.sleep(every)

    # --- reading the cluster -----------------------------------------------------------------------------
    def sandbox_obj(self, name: str) -> dict[str, Any] | None:
        out = self.cluster.kubectl("get", "rsb", name, "-n", NAMESPACE, "-o", "json", check=False)
        if out.returncode != 0:
            return None
        obj: dict[str, Any] = json.loads(out.stdout)
        size = (obj.get("status") or {}).get("sizeBytes")
        if size and name in self.sandboxes:
            self.sandboxes[name].size = int(size)
        return obj

    def phase(self, name: str) -> str | None:
        obj = self.sandbox_obj(name)
        return None if obj is None else (obj.get("status") or {}).get("phase")

    def gone(self, name: str) -> bool:
        """Deleted from the API and its directory gone from its node's disk."""
        sandbox = self.sandboxes[name]
        on_disk = (self.roots[sandbox.node] / NAMESPACE / name).exists()
        return self.sandbox_obj(name) is None and not on_disk

    def metrics(self, node: str) -> str:
        url = f"http://127.0.0.1:{self.metrics_ports[node]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text: str = response.read().decode()
        return text

    def agent_metrics(self, node: str) -> None:
        """Wait until the agent on `node` serves metrics, and remember its port."""
        found = self.wait(
            f"the agent on {node} to serve metrics", lambda: re.search(r"metrics_port=(\d+)", self.agent_log(node))
        )
        self.metrics_ports[node] = int(found.group(1))

    def objects(self, namespace: str) -> dict[str, dict[str, Any]]:
        """The namespace's RetainedSandboxes by name."""
        out = self.cluster.kubectl("get", "rsb", "-n", namespace, "-o", "json")
        return {o["metadata"]["name"]: o for o in json.loads(out.stdout)["items"]}

    def agent_log(self, node: str) -> str:
        proc = next(p for p in self.procs if p.name == f"agent {node}")
        assert proc.log is not None
        return proc.log.read_text(errors="replace")

    @staticmethod
    def seconds(duration: str) -> float:
        """A duration setting (`40s`, `2m`) in seconds (validated when the arguments were parsed)."""
        parsed = parse_duration(duration)
        assert not isinstance(parsed, Invalid)
        return parsed.total_seconds()

    def before_deadline(self, name: str, what: str) -> None:
        """Fail clearly when a set-up step comes after the sandbox it prepares has already expired."""
        text = ((self.sandbox_obj(name) or {}).get("status") or {}).get("deadline")
        until = instant_or_none(text)
        if until is None or until - now_utc() < timedelta(seconds=2):
            raise DemoFailed(f"{what} had to happen before {name}'s deadline ({text}); {SLOW_HINT}")

    def table(self) -> None:
        self.kubectl("get", "rsb", "-A", show=True)


def _wrap(text: str) -> list[str]:
    """Narration wrapped for a terminal, never breaking inside a path or a name with hyphens."""
    return textwrap.wrap(text, WIDTH - 4, break_on_hyphens=False, break_long_words=False)


def _short_paths(text: str, demo: Demo) -> str:
    """Paths under the demo's temporary directory as `$DEMO/...`, so the output reads the same every run."""
    return text.replace(str(demo.workdir), "$DEMO")


def _noise_free(stderr: str) -> str:
    """A command's log lines, without the timestamp prefix (the demo prints its own elapsed time)."""
    lines = []
    for line in stderr.splitlines():
        m = re.match(r"^\S+Z (\w+)\s+[\w.]+: (.*)$", line)
        lines.append(m.group(2) if m else line)
    return "\n".join(lines) + ("\n" if lines else "")


def log_lines(text: str, event: str) -> list[str]:
    """The logfmt lines of one decision (`event`) from a component's log, timestamps and logger cut."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\S+Z \w+\s+[\w.]+: (.*)$", line)
        if m and m.group(1).split(" ", 1)[0] == event:
            out.append(m.group(1))
    return out


def stuck_metric_lines(text: str, node: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line.startswith("sandkeep_") and "stuck" in line.split("{")[0] and f'node="{node}"' in line
    ]


def stuck_lines_when(demo: Demo, node: str, want: Callable[[float], bool]) -> list[str] | None:
    """The agent's `sandkeep_*stuck*` samples once its stuck-tombstone count satisfies `want`, else None."""
    lines = stuck_metric_lines(demo.metrics(node), node)
    return lines if lines and want(metric_value(lines, c.M_TOMBSTONES_STUCK)) else None


def metric_value(lines: list[str], name: str) -> float:
    for line in lines:
        if line.split("{")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: with the pid, it names one process (a pid alone can be reused)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split(" ")
    return int(fields[19]) if len(fields) > 19 and fields[0] not in ("Z", "X") else None


def alive(pid: int, ticks: int) -> bool:
    return start_ticks(pid) == ticks


def make_job(path: Path, files: int) -> None:
    """A finished job's workspace: a log, a result and `files` small source files in a few directories."""
    path.mkdir(parents=True)
    (path / "build.log").write_text("".join(f"step {i}: ok\n" for i in range(200)))
    (path / "result.json").write_text(json.dumps({"status": "passed"}) + "\n")
    for i in range(max(0, files - 2)):
        sub = path / "src" / f"pkg{i % 30:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"file{i:05d}.py").write_text(f"# generated file {i}\nVALUE = {i}\n" + "x = 1\n" * 20)


# --- the story ---------------------------------------------------------------------------------------------


def install(demo: Demo) -> None:
    demo.step(
        "Install sandkeep's API into the cluster",
        "The CRDs (RetainedSandbox, short name rsb, and SandboxPolicy) are applied with kubectl, two Node "
        "objects stand in for two machines (no kubelet runs here), and a SandboxPolicy gives the demo "
        f"namespace a retention window of {demo.window} instead of days, so the story fits in two minutes.",
    )
    demo.kubectl("apply", "-f", str(REPO / "crds"), show=True)
    demo.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd", "--all")
    for ns in (SYSTEM_NAMESPACE, NAMESPACE):
        demo.kubectl("create", "namespace", ns)
    for node in NODES:
        demo.cluster.create_node(node, ready=True)
    policy = {
        "apiVersion": c.API_VERSION,
        "kind": c.POLICY_KIND,
        "metadata": {"name": "short-window", "namespace": NAMESPACE},
        "spec": {"retention": demo.window, "maxPin": "24h"},
    }
    demo.cluster.apply(policy)
    demo.kubectl("get", "nodes", show=True)
    demo.kubectl("get", "sandboxpolicy", "-n", NAMESPACE, show=True)
    demo.ok("CRDs established, 2 nodes, the demo namespace's policy in place")


def start_components(demo: Demo) -> None:
    demo.step(
        "Start the controller and one agent per node",
        "The controller (a Deployment in a real cluster) decides keep or delete with one expiry rule; each "
        "agent (a DaemonSet pod on a real node) owns its node's root directory: it adopts retained "
        "directories as RetainedSandbox objects, reports what it sees, and does the deleting. Here they are "
        "plain processes; the agents scan every second and call a tombstone stuck after 3s (default 10m).",
    )
    logs = demo.workdir / "logs"
    logs.mkdir()
    kubeconfig = str(demo.cluster.kubeconfig)
    ignore = uninspectable_pids()
    if ignore:
        demo.say(
            f"(This machine has {len(ignore)} process(es) even root cannot inspect; an agent would hold every "
            "sandbox as 'use cannot be ruled out', so they are vouched for with --ignore-pid.)"
        )
    common = [f"--kubeconfig={kubeconfig}", f"--lease-namespace={SYSTEM_NAMESPACE}", "--metrics-port=0"]
    controller_args = [*demo.sandkeep, "controller", *common, "--lease-duration=5"]
    controller = demo.start("controller", controller_args, logs / "controller.log")
    timing = ["--scan-interval=1s", "--stuck-after=3s", "--orphan-timeout=3s"]
    demo.agent_args = [*common, *timing]
    # Their roots share this machine's disk, however full it is: releasing for space is off for them
    # (the disk-pressure step runs a node of its own on a small filesystem).
    timing = [*timing, "--pressure-high=100"]
    for node in NODES:
        root = demo.workdir / f"{node}-root"
        demo.roots[node] = root
        args = [*demo.sandkeep, "agent", f"--node={node}", f"--root={root}", *common, *timing]
        args += [f"--ignore-pid={pid}" for pid in ignore]
        demo.start(f"agent {node}", args, logs / f"agent-{node}.log")
    controller_log = controller.log
    assert controller_log is not None
    demo.wait("the controller to take the leader Lease", lambda: "leader_elected" in controller_log.read_text())

    for node in NODES:
        demo.agent_metrics(node)
        demo.wait(
            f"the agent on {node} to send its first heartbeat",
            lambda n=node: demo.kubectl(  # type: ignore[misc]
                "get", "lease", f"{c.AGENT_LEASE_PREFIX}{n}", "-n", SYSTEM_NAMESPACE, check=False
            ),
        )
    demo.kubectl("get", "leases", "-n", SYSTEM_NAMESPACE, show=True)
    demo.ok("controller leading; agents on node-a and node-b heartbeating (one Lease each)")


def retain_all(demo: Demo) -> None:
    demo.step(
        "Jobs finish: retain their workspaces on both nodes",
        "`sandkeep retain` moves a finished job's directory under the node's root by rename (never a copy) "
        f"and writes a manifest. One job records its own shorter deadline ({demo.recorded}); the others get the "
        f"namespace's {demo.window} window. The agents adopt each directory as a RetainedSandbox object, with "
        "their finalizer on it, and measure its size.",
    )
    jobs = demo.workdir / "jobs"
    commands = []
    for s in demo.sandboxes.values():
        src = jobs / s.node / s.name
        make_job(src, s.files)
        where = [f"--root={demo.roots[s.node]}", f"--namespace={NAMESPACE}", f"--name={s.name}", f"--node={s.node}"]
        args = ["retain", *where, str(src)]
        if s.recorded:
            args.insert(-1, f"--retention={s.recorded}")
        commands.append(args)
    # the six jobs end at about the same time: their retains run side by side, as on real nodes
    for args, result in zip(commands, demo.run_many(commands), strict=True):
        demo.show_sandkeep(args, result)

    def measured(name: str) -> str | None:
        size = ((demo.sandbox_obj(name) or {}).get("status") or {}).get("sizeBytes")
        return demo.phase(name) if size else None

    for s in demo.sandboxes.values():
        demo.wait(f"{s.name} to be adopted with its size measured", functools.partial(measured, s.name))
    demo.table()
    big = demo.sandbox_obj("build-1042") or {}
    files = big.get("status", {}).get("fileCount")
    if files is None or int(files) < MANY_FILES:
        raise DemoFailed(f"build-1042 should report at least {MANY_FILES} files, status says {files}")
    demo.ok(f"{len(demo.sandboxes)} sandboxes adopted on 2 nodes (build-1042 holds {files} files)")


def pin(demo: Demo) -> None:
    demo.step(
        "Pin one: kubectl annotate rsb/build-1043 sandkeep.io/pin-for=1h",
        "Someone still needs build-1043. A pin is an annotation anyone allowed to edit the namespace can "
        "set; the controller turns the relative pin-for into an absolute pin-until once, so the object "
        "always shows the real deadline.",
    )
    columns = (
        "custom-columns=NAME:.metadata.name,PHASE:.status.phase,DEADLINE:.status.deadline,SOURCE:.status.deadlineSource"
    )
    demo.kubectl("get", "rsb", "build-1043", "-n", NAMESPACE, "-o", columns, show=True)
    before = (demo.sandbox_obj("build-1043") or {}).get("status", {}).get("deadline")
    demo.before_deadline("build-1043", "the pin")
    demo.kubectl("annotate", "rsb/build-1043", "-n", NAMESPACE, f"{c.ANN_PIN_FOR}=1h", show=True)
    demo.wait(
        "build-1043 to be Pinned with its deadline an hour away",
        lambda: (
            (demo.sandbox_obj("build-1043") or {}).get("status", {}).get("deadlineSource") == "pin"
            and demo.phase("build-1043") == "Pinned"
        ),
        timeout=30,
    )
    demo.kubectl("get", "rsb", "build-1043", "-n", NAMESPACE, "-o", columns, show=True)
    obj = demo.sandbox_obj("build-1043") or {}
    ann = obj["metadata"].get("annotations") or {}
    demo.kubectl("get", "rsb", "build-1043", "-n", NAMESPACE, "-o", "jsonpath={.metadata.annotations}", show=True)
    if c.ANN_PIN_FOR in ann or c.ANN_PIN_UNTIL not in ann:
        raise DemoFailed(f"pin-for should have become pin-until, annotations are {ann}")
    demo.ok(f"deadline moved from {before} to {obj['status']['deadline']} (source: pin)")


def open_file(demo: Demo) -> None:
    demo.step(
        "Look inside it: kubectl sandkeep ls, then read a file of build-1043 with `sandkeep exec`",
        "Keeping a workspace is for looking inside it. `kubectl sandkeep ls` lists sandboxes with their size, "
        "deadline and pin. On the node, `sandkeep exec` opens one (refusing an expired or half-deleted one). "
        "From the cluster, `kubectl sandkeep open build-1043 -- cat result.json` does the same through a "
        "SandboxSession Pod on the sandbox's node; this demo's nodes have no kubelet, so `make demo-node` "
        "shows that one.",
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{tools_bin(CLUSTER_TOOLS)}:{os.environ['PATH']}"}
    listed = subprocess.run(
        ["kubectl", "sandkeep", "ls", f"--kubeconfig={demo.cluster.kubeconfig}", "-n", NAMESPACE],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    demo.show(f"kubectl sandkeep ls -n {NAMESPACE}", listed.stdout + listed.stderr)
    if listed.returncode != 0 or "build-1043" not in listed.stdout:
        raise DemoFailed(f"kubectl sandkeep ls failed: {listed.stderr.strip()}")
    root = demo.roots["node-a"]
    demo.before_deadline("build-1043", "opening it")
    out = demo.run_sandkeep("exec", f"{NAMESPACE}/build-1043", f"--root={root}", "--", "cat", "result.json")
    if json.loads(out) != {"status": "passed"}:
        raise DemoFailed(f"build-1043's result.json read back as {out!r}")
    demo.ok("read result.json from build-1043's workspace, where the job left it")


def hold_in_use(demo: Demo) -> Proc:
    demo.step(
        "Keep one in use: a live process inside agent-run-17",
        "A debugging shell is still open in agent-run-17's workspace (here: a `sleep` whose working "
        "directory is inside it). The agent finds it in /proc and reports the sandbox in use; an expired "
        "sandbox that is in use is Held, never deleted.",
    )
    workspace = demo.roots["node-b"] / NAMESPACE / "agent-run-17" / c.WORKSPACE_DIR
    demo.before_deadline("agent-run-17", "starting the process that uses it")
    sleeper = demo.start("in-use sleep", ["sleep", "600"], cwd=workspace)
    demo.say(f"started pid {sleeper.popen.pid}: sleep 600 (cwd {_short_paths(str(workspace), demo)})")
    holder = f"pid {sleeper.popen.pid} (sleep) cwd"
    demo.wait(
        f"agent-run-17 to be reported in use by {holder}",
        lambda: holder in ((demo.sandbox_obj("agent-run-17") or {}).get("status", {}).get("heldBy") or []),
        timeout=30,
    )
    demo.kubectl("get", "rsb", "agent-run-17", "-n", NAMESPACE, "-o", IN_USE_COLUMNS, show=True)
    demo.ok(f"agent on node-b reports agent-run-17 in use by pid {sleeper.popen.pid}")
    return sleeper


def orphan(demo: Demo) -> list[tuple[int, int]]:
    demo.step(
        "Leave an orphan: run a command with `sandkeep exec`, then SIGKILL the recorder",
        "`sandkeep exec` runs a command in a sandbox as a session of its own and records every process "
        "of it (pid + start time + boot id) on disk while it runs. If the recorder is killed, the "
        "command's background processes live on, untracked by anyone else. They are debris, not users: "
        "the agent reports the sandbox not in use (naming the orphans), and before it is deleted kills "
        "exactly the recorded processes, never a reused pid.",
    )
    root = demo.roots["node-b"]
    demo.before_deadline("agent-run-18", "starting the command")
    command = ["sh", "-c", "sleep 600 & sleep 600"]
    recorder_args = [*demo.sandkeep, "exec", f"{NAMESPACE}/agent-run-18", f"--root={root}", "--", *command]
    recorder = demo.start("sandkeep exec", recorder_args)
    demo.say(
        f"started pid {recorder.popen.pid}: sandkeep exec demo/agent-run-18 --root $DEMO/node-b-root -- "
        "sh -c 'sleep 600 & sleep 600'"
    )
    commands_dir = root / NAMESPACE / "agent-run-18" / c.COMMANDS_DIR

    def recorded() -> tuple[str, list[tuple[int, int]]] | None:
        for record in commands_dir.glob("*.json"):
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                text = record.read_text()
                body = json.loads(text)
                marks = [body["leader"], *body.get("members", [])]
                if len(marks) >= 3:  # the shell and both sleeps
                    return text, [(int(m["pid"]), int(m["start"])) for m in marks]
        return None

    text, marks = demo.wait("the command's three processes to be recorded", recorded, timeout=20)
    demo.extra_pids.extend(marks)
    demo.show(f"cat $DEMO/node-b-root/demo/agent-run-18/{c.COMMANDS_DIR}/*.json", text)
    demo.stop(next(p for p in demo.procs if p is recorder), signal.SIGKILL)
    demo.procs.remove(recorder)
    # stop() signals the group the recorder leads; the command runs in a session of its own and lives on
    if not all(alive(pid, ticks) for pid, ticks in marks):
        raise DemoFailed("the recorded command should have outlived its SIGKILLed recorder")
    ps = subprocess.run(
        ["ps", "-o", "pid,pgid,args", "-p", ",".join(str(p) for p, _ in marks)],
        capture_output=True,
        text=True,
        check=False,
    )
    demo.show(f"kill -9 {recorder.popen.pid}; ps -o pid,pgid,args -p ...", ps.stdout)
    demo.ok(f"recorder killed; orphans {' '.join(str(p) for p, _ in marks)} still running inside agent-run-18")
    demo.wait(
        "the agent on node-b to report agent-run-18 not in use, its orphans pending",
        lambda: orphans_pending(demo, "agent-run-18"),
        timeout=20,
    )
    demo.kubectl("get", "rsb", "agent-run-18", "-n", NAMESPACE, "-o", IN_USE_COLUMNS, show=True)
    demo.ok("agent-run-18 reported not in use: its orphans will be reaped before it is deleted")
    return marks


def orphans_pending(demo: Demo, name: str) -> bool:
    """The agent reports `name` used only by recorded orphans: inUse false, InUse reason OrphansPending."""
    obj = demo.sandbox_obj(name) or {}
    cond = condition_of(obj, c.Condition.IN_USE) or {}
    return (obj.get("status") or {}).get("inUse") is False and cond.get("reason") == str(c.Reason.ORPHANS_PENDING)


def undeletable(demo: Demo) -> None:
    demo.step(
        "Make one undeletable: chattr +i on a file in build-1044",
        "Real disks have files nobody can delete (an immutable attribute, a bind mount, a read-only "
        "filesystem). sandkeep renames the sandbox aside to a tombstone first, so it disappears from "
        "its name at once, and keeps retrying the delete; a tombstone that stays is 'stuck' and alerts.",
    )
    target = demo.roots["node-b"] / NAMESPACE / "build-1044" / c.WORKSPACE_DIR / "build.log"
    demo.before_deadline("build-1044", "making it undeletable")
    demo.immutable.append(target)
    subprocess.run(["chattr", "+i", str(target)], check=True)
    lsattr = subprocess.run(["lsattr", str(target)], capture_output=True, text=True, check=False)
    demo.show(f"chattr +i {_short_paths(str(target), demo)}; lsattr", _short_paths(lsattr.stdout.strip(), demo))
    demo.ok("build-1044/workspace/build.log is immutable (even root cannot unlink it)")


def expiry(demo: Demo) -> None:
    demo.step(
        "Deadlines pass: the controller deletes what may go, and nothing else",
        "Each sandbox's deadline is the earlier of the one recorded at retention and createdAt + the "
        "window; a valid pin wins over both. The controller wakes at each deadline (no polling), reads "
        "the object fresh, and deletes it with a resourceVersion precondition. The agent's finalizer then "
        "renames the directory to a tombstone, deletes it, and lets the object go.",
    )
    demo.wait(
        f"build-1042 (its recorded {demo.recorded} deadline) to be deleted from the API and from node-a's disk",
        lambda: demo.gone("build-1042"),
        timeout=demo.seconds(demo.recorded) + 30,
    )
    demo.sandboxes["build-1042"].deleted = True
    demo.ok("build-1042 deleted (API object and directory)")
    selector = "--field-selector=involvedObject.name=build-1042"
    demo.kubectl("get", "events", "-n", NAMESPACE, selector, "--sort-by=.lastTimestamp", show=True)
    demo.say(f"...waiting for the {demo.window} window of the others to pass")
    demo.wait(
        "agent-run-17 to be Held (expired, but in use)",
        lambda: demo.phase("agent-run-17") == "Held",
        demo.seconds(demo.window) + 30,
    )
    demo.wait(
        "agent-run-18 to be deleted (expired; its orphans do not hold it, nobody ran kubectl delete)",
        lambda: demo.gone("agent-run-18"),
        30,
    )
    demo.sandboxes["agent-run-18"].deleted = True
    demo.wait(
        "build-1044 to be Stuck (its tombstone cannot be deleted)", lambda: demo.phase("build-1044") == "Stuck", 30
    )
    demo.table()
    if demo.phase("build-1043") != "Pinned":
        raise DemoFailed(f"build-1043 is pinned for an hour and must still be Pinned, it is {demo.phase('build-1043')}")
    demo.ok("pinned one kept; the one in use Held; the orphans' one deleted; the undeletable one Stuck")


def stuck(demo: Demo) -> None:
    demo.step(
        "See the stuck tombstone the way an operator would",
        "The object stays Terminating with phase Stuck and a condition naming the errno and the path; the "
        "agent exports it as metrics (the SandkeepTombstoneStuck alert fires on them after 10 minutes) and "
        "`sandkeep doctor` lists what needs a person.",
    )
    if condition_of(demo.sandbox_obj("build-1044") or {}, c.Condition.TOMBSTONE_STUCK) is None:
        raise DemoFailed(f"build-1044 is Stuck but has no {c.Condition.TOMBSTONE_STUCK} condition")
    stuck_message = 'jsonpath={.status.phase}: {.status.conditions[?(@.type=="TombstoneStuck")].message}'
    demo.kubectl("get", "rsb", "build-1044", "-n", NAMESPACE, "-o", stuck_message, show=True)
    lines = demo.wait(
        "the agent on node-b to export a stuck tombstone",
        lambda: stuck_lines_when(demo, "node-b", lambda stuck: stuck >= 1),
        timeout=30,
    )
    curl = f"curl -s http://127.0.0.1:{demo.metrics_ports['node-b']}/metrics | grep '^sandkeep_.*stuck'"
    demo.show(curl, "\n".join(lines))
    out = demo.run_sandkeep("doctor", f"--kubeconfig={demo.cluster.kubeconfig}", show=False, ok_codes=(1,))
    demo.show("sandkeep doctor", _short_paths(out, demo))
    if "build-1044" not in out.split("Held sandboxes")[0]:
        raise DemoFailed("sandkeep doctor should name demo/build-1044 under stuck tombstones")
    demo.ok("phase Stuck, metric sandkeep_tombstones_stuck=1 on node-b, doctor names demo/build-1044 (exit 1)")


def recover(demo: Demo) -> None:
    demo.step(
        "Fix the cause: chattr -i, and the agent finishes by itself",
        "Nobody has to tell sandkeep: the agent retries stuck tombstones on every pass, so once the file "
        "can be deleted the tombstone goes, the finalizer is removed and the object disappears.",
    )
    tombstone = ((demo.sandbox_obj("build-1044") or {}).get("status") or {}).get("tombstone")
    if not tombstone:
        raise DemoFailed("build-1044 is Stuck but its status names no tombstone")
    # the file moved with the rename: it now sits inside the tombstone the condition names
    path = demo.roots["node-b"] / tombstone / c.WORKSPACE_DIR / "build.log"
    demo.immutable.append(path)
    subprocess.run(["chattr", "-i", str(path)], check=True)
    demo.say(f"$ chattr -i {_short_paths(str(path), demo)}")
    demo.wait("build-1044 to be deleted after the attribute is cleared", lambda: demo.gone("build-1044"), 30)
    demo.sandboxes["build-1044"].deleted = True
    lines = demo.wait(
        "node-b's stuck-tombstone metric to return to 0",
        lambda: stuck_lines_when(demo, "node-b", lambda stuck: stuck == 0),
        timeout=20,
    )
    curl = f"curl -s http://127.0.0.1:{demo.metrics_ports['node-b']}/metrics | grep '^sandkeep_.*stuck'"
    demo.show(curl, "\n".join(lines))
    demo.ok("build-1044 deleted; no stuck tombstone left on node-b")


def release(demo: Demo, sleeper: Proc) -> None:
    demo.step(
        "The process in agent-run-17 ends: the hold lifts",
        "Holds are re-checked every pass. Once nothing uses the directory the agent says so, the "
        "controller's verdict becomes delete, and the agent checks in-use once more right before the rename.",
    )
    demo.stop(sleeper, signal.SIGTERM)
    demo.say(f"$ kill {sleeper.popen.pid}")
    demo.wait("agent-run-17 to be deleted once its process exited", lambda: demo.gone("agent-run-17"), 30)
    demo.sandboxes["agent-run-17"].deleted = True
    demo.ok("agent-run-17 deleted")


def reap(demo: Demo, marks: list[tuple[int, int]]) -> None:
    demo.step(
        "How the orphans' sandbox went: orphans killed first, then the directory",
        "agent-run-18 expired with its orphans still running in it. Orphans do not count as users, so the "
        "controller asked for the deletion at the deadline like for any other sandbox; before renaming "
        "the directory, the agent killed the recorded orphan processes (each proven of the command's session "
        "and working inside the sandbox, through a pidfd), checked that "
        "nothing else uses it, and only then deleted it.",
    )
    survivors = [pid for pid, ticks in marks if alive(pid, ticks)]
    if survivors:
        raise DemoFailed(f"the orphans {survivors} should have been killed before agent-run-18 was deleted")
    lines = [x for x in log_lines(demo.agent_log("node-b"), "orphans_reaped") if "agent-run-18" in x]
    lines += [x for x in log_lines(demo.agent_log("node-b"), "deleted") if "agent-run-18" in x]
    if not lines or "orphans_reaped" not in lines[0]:
        raise DemoFailed("the agent on node-b should have logged orphans_reaped for agent-run-18")
    title = "the agent's log on node-b, its decisions about agent-run-18 (timestamps cut):"
    demo.show(title, "\n".join(lines), command=False)
    demo.ok(f"orphans {' '.join(str(p) for p, _ in marks)} killed, then agent-run-18 deleted")


def finale(demo: Demo) -> None:
    demo.step("What is left", "The final table, each node's disk, and the tally.")
    demo.table()
    for node, root in demo.roots.items():
        entries = sorted(str(p.relative_to(root)) for p in root.glob(f"{NAMESPACE}/*") if p.is_dir())
        leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(c.TOMBSTONE_PREFIX))
        gone = sorted(s.name for s in demo.sandboxes.values() if s.node == node and s.deleted)
        print(
            f"    {node} root $DEMO/{root.name}: on disk {entries or '(none)'}; deleted {gone}; "
            f"tombstones left {leftovers or 'none'}"
        )
        if leftovers:
            raise DemoFailed(f"{node} still has tombstones: {leftovers}")
        for s in demo.sandboxes.values():
            if s.node == node and (root / NAMESPACE / s.name).exists() == s.deleted:
                raise DemoFailed(f"{s.name} on {node}: deleted={s.deleted} but on disk={not s.deleted}")
    deleted = [s for s in demo.sandboxes.values() if s.deleted]
    freed = sum(s.size for s in deleted)
    print()
    print(f"    sandboxes retained : {len(demo.sandboxes)} (on {len(NODES)} nodes)")
    print("    pinned             : 1 (build-1043, kept for an hour)")
    print("    held while in use  : 1 (agent-run-17 by a live process, deleted once it exited)")
    print("    orphans reaped     : agent-run-18's, at its deadline, right before it was deleted")
    print(f"    deleted            : {len(deleted)} ({', '.join(s.name for s in deleted)})")
    print("    stuck, then fixed  : 1 (build-1044: immutable file, recovered after chattr -i)")
    print(f"    released for space : 2 on {PRESSURE_NODE} (run-1, run-3: oldest unpinned; pinned run-2 kept)")
    print(f"    bytes freed        : {freed} ({freed / 1024 / 1024:.1f} MiB, as measured by the agents)")
    remaining = {s.name for s in demo.sandboxes.values() if not s.deleted}
    if remaining != {"build-1043"}:
        raise DemoFailed(f"only the pinned build-1043 should remain, but {sorted(remaining)} do")


PRESSURE_NODE = "node-c"
PRESSURE_NAMESPACE = "ci-runs"
PRESSURE_DISK = 64  # MiB: a tmpfs standing in for a node's disk
PRESSURE_RUN = 8  # MiB per retained run
PRESSURE_SCRATCH = 20  # MiB another workload writes to the same disk
PRESSURE_HIGH, PRESSURE_LOW = 75, 60  # percent used: above high, release until the projection is under low


def disk_pressure(demo: Demo) -> None:
    demo.step(
        f"A node's disk fills: sandkeep frees it before the kubelet evicts Pods ({PRESSURE_NODE})",
        f"A third node whose disk is a {PRESSURE_DISK} MiB tmpfs keeps four CI runs of {PRESSURE_RUN} MiB in "
        f"namespace {PRESSURE_NAMESPACE} (the cluster's 72h window: none expires), one of them pinned for a week. Then "
        f"another workload writes {PRESSURE_SCRATCH} MiB to the same disk. Above its high watermark "
        f"({PRESSURE_HIGH}% used here; 85% by default, below the kubelet's eviction at 90%) the agent releases "
        f"the oldest unpinned, unheld runs until the disk is projected under its low watermark ({PRESSURE_LOW}%).",
    )
    disk = demo.workdir / f"{PRESSURE_NODE}-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={PRESSURE_DISK}m,mode=0700", "tmpfs", str(disk)], check=True)
    demo.mounts.append(disk)
    root = disk / "sandkeep"
    demo.cluster.create_node(PRESSURE_NODE, ready=True)
    demo.kubectl("create", "namespace", PRESSURE_NAMESPACE)
    marks = [f"--pressure-high={PRESSURE_HIGH}", f"--pressure-low={PRESSURE_LOW}"]
    args = [*demo.sandkeep, "agent", f"--node={PRESSURE_NODE}", f"--root={root}", *demo.agent_args, *marks]
    args += [f"--ignore-pid={pid}" for pid in uninspectable_pids()]
    demo.start(f"agent {PRESSURE_NODE}", args, demo.workdir / "logs" / f"agent-{PRESSURE_NODE}.log")
    demo.agent_metrics(PRESSURE_NODE)
    runs = ["run-1", "run-2", "run-3", "run-4"]  # oldest first
    jobs = disk / "jobs"  # on the node's disk: sandkeep retains by rename, never by copy
    for age, name in zip((4, 3, 2, 1), runs, strict=True):
        src = jobs / name
        src.mkdir(parents=True)
        (src / "cache.bin").write_bytes(os.urandom(PRESSURE_RUN << 20))
        created = (now_utc() - timedelta(hours=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
        where = [f"--root={root}", f"--namespace={PRESSURE_NAMESPACE}", f"--name={name}", f"--node={PRESSURE_NODE}"]
        demo.run_sandkeep("retain", *where, f"--created-at={created}", str(src), show=False)

    def runs_now() -> dict[str, dict[str, Any]]:
        return demo.objects(PRESSURE_NAMESPACE)

    def measured() -> bool:
        objs = runs_now()
        return len(objs) == len(runs) and all((o.get("status") or {}).get("sizeBytes") for o in objs.values())

    def pinned() -> bool:
        return (runs_now().get("run-2") or {}).get("status", {}).get("phase") == c.Phase.PINNED

    demo.wait(f"the four runs on {PRESSURE_NODE} to be adopted and measured", measured)
    demo.kubectl("annotate", "rsb/run-2", "-n", PRESSURE_NAMESPACE, f"{c.ANN_PIN_FOR}=7d", show=True)
    demo.wait("run-2 to be Pinned", pinned)
    demo.kubectl("get", "rsb", "-n", PRESSURE_NAMESPACE, show=True)
    demo.show("df", _df(disk), command=False)
    scratch = disk / "scratch"
    scratch.mkdir()
    (scratch / "layer.tar").write_bytes(os.urandom(PRESSURE_SCRATCH << 20))
    demo.say(f"another workload wrote {PRESSURE_SCRATCH} MiB to the same disk:")
    demo.show("df", _df(disk), command=False)
    expected = {"run-2", "run-4"}

    def on_disk() -> set[str]:
        return {p.name for p in (root / PRESSURE_NAMESPACE).iterdir()}

    demo.wait(
        "the oldest unpinned runs (run-1, run-3) to be released and deleted, the pinned run-2 kept",
        lambda: set(runs_now()) == expected and on_disk() == expected,
        timeout=60,
    )
    demo.kubectl("get", "rsb", "-n", PRESSURE_NAMESPACE, show=True)
    demo.show("df", _df(disk), command=False)
    selector = ["--field-selector", f"reason={c.Reason.DISK_PRESSURE}"]
    events = demo.kubectl("get", "events", "-n", PRESSURE_NAMESPACE, *selector, "-o", "json")
    words = [f"{e['involvedObject']['name']}: {e['message']}" for e in json.loads(events)["items"]]
    demo.show("Events with reason DiskPressure", "\n".join(words), command=False)
    releases = metric_value(demo.metrics(PRESSURE_NODE).splitlines(), c.M_PRESSURE_RELEASES)
    if releases != 2:
        raise DemoFailed(f"{c.M_PRESSURE_RELEASES} should count 2 releases, it says {releases}")
    demo.ok(f"run-1 and run-3 released ({c.M_PRESSURE_RELEASES} = 2); pinned run-2 and the newest run-4 kept")


def _df(path: Path) -> str:
    vfs = os.statvfs(path)
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    return f"{path.name}: {(size - free) >> 20} MiB used of {size >> 20} MiB ({100 * (size - free) / size:.0f}%)"


STORY: tuple[Sandbox, ...] = (
    Sandbox("build-1042", "node-a", files=MANY_FILES, recorded="set by --recorded"),  # goes first, by its own deadline
    Sandbox("build-1043", "node-a"),  # pinned for an hour: kept
    Sandbox("build-1045", "node-a"),  # plain: deleted when the window closes
    Sandbox("agent-run-17", "node-b"),  # in use by a live process: held, deleted after it exits
    Sandbox("agent-run-18", "node-b"),  # an orphan command: not a user; reaped at expiry, then deleted
    Sandbox("build-1044", "node-b"),  # an immutable file: stuck, then recovers
)


def play(demo: Demo) -> None:
    demo.sandboxes = {s.name: Sandbox(**vars(s)) for s in STORY}
    demo.sandboxes["build-1042"].recorded = demo.recorded
    install(demo)
    start_components(demo)
    retain_all(demo)
    pin(demo)
    open_file(demo)
    sleeper = hold_in_use(demo)
    marks = orphan(demo)
    undeletable(demo)
    expiry(demo)
    reap(demo, marks)
    demo.wait("build-1045 (plain, window passed) to be deleted", lambda: demo.gone("build-1045"), 30)
    demo.sandboxes["build-1045"].deleted = True
    stuck(demo)
    recover(demo)
    release(demo, sleeper)
    disk_pressure(demo)
    finale(demo)


# --- set-up and clean-up -----------------------------------------------------------------------------------


def sandkeep_command() -> list[str]:
    """The `sandkeep` console script next to this Python (the virtualenv's), else its module."""
    script = Path(sys.executable).parent / "sandkeep"
    return [str(script)] if script.exists() else [sys.executable, "-m", "controller.cli.sandkeep"]


def cleanup(demo: Demo) -> None:
    """Undo everything, in an order that cannot leave debris: attributes, processes, orphans, files."""
    for path in demo.immutable:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    for proc in reversed(demo.procs):
        demo.stop(proc)
    for pid, ticks in demo.extra_pids:
        if alive(pid, ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for root in demo.roots.values():
        if root.exists():
            subprocess.run(["chattr", "-R", "-i", str(root)], capture_output=True, check=False)
    for mount in reversed(demo.mounts):
        subprocess.run(["umount", str(mount)], capture_output=True, check=False)


def print_logs(demo: Demo) -> None:
    for proc in demo.procs:
        if proc.log is not None and proc.log.exists():
            tail = proc.log.read_text(errors="replace").splitlines()[-25:]
            print(f"----- {proc.name} (last {len(tail)} lines) -----", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)
    print(demo.cluster.logs(15), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, help="parent of the demo's temporary directory (default: system temp)")
    parser.add_argument("--window", default=WINDOW, help=f"the demo namespace's retention window (default {WINDOW})")
    parser.add_argument("--recorded", default=RECORDED, help=f"build-1042's recorded deadline (default {RECORDED})")
    args = parser.parse_args(argv)
    for value in (args.window, args.recorded):
        if isinstance(parse_duration(value), Invalid):
            parser.error(f"{value!r} is not a duration such as 40s or 2m")
    if os.geteuid() != 0:
        print("demo: needs root (chattr +i, and reading every process's /proc entries)", file=sys.stderr)
        return 2
    try:
        bin_dir = tools_bin(CLUSTER_TOOLS)
    except ClusterError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-demo-", dir=args.workdir))
    print(f"sandkeep demo: everything lives in {workdir} ($DEMO below) and is removed at the end")
    cluster = LocalCluster(workdir, bin_dir)
    demo = Demo(workdir, cluster, sandkeep_command(), window=args.window, recorded=args.recorded)
    code = 1
    with signals_raise():
        try:
            demo.step(
                "Start a local control plane",
                "A real etcd, kube-apiserver and kube-controller-manager on 127.0.0.1, built from pinned Go "
                "modules: every request below is decided by the same code a production cluster runs.",
            )
            cluster.start()
            demo.ok(f"kube-apiserver {cluster.server} ready in {cluster.startup_seconds:.1f}s")
            play(demo)
            print(f"\n[{demo.elapsed()}] Demo complete: every step did what it should.")
            code = 0
        except DemoFailed as err:
            print(f"\n[{demo.elapsed()}] DEMO FAILED at step {demo.step_no}: {err}", file=sys.stderr)
            print_logs(demo)
        except KeyboardInterrupt:
            print(f"\n[{demo.elapsed()}] interrupted: cleaning up", file=sys.stderr)
            code = 130
        finally:
            cleanup(demo)
            cluster.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
