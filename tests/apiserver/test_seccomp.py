"""The agent's seccomp profile (charts/sandkeep/files/agent-seccomp.json, chart value `agent.seccomp`).

The agent holds CAP_SYS_PTRACE for one reason: to read other users' /proc/<pid>/{cwd,root,fd,maps}, which
the kernel gates with a ptrace *access check*, not with the ptrace system call. The profile denies the
calls that capability would otherwise open up (ptrace, process_vm_readv/writev, pidfd_getfd, kcmp,
process_madvise) and allows an explicit list of everything else the agent needs; anything not listed is
refused. Here: the profile's rules, and a real agent recorded with strace while it does its whole job
(adoption, holds by another user's cwd and open file, orphan reaping, a stuck tombstone, deletion,
metrics, shutdown) makes no call outside the list and never calls ptrace. On a real node
(tests/node/test_e2e.py) the agent Pod runs under it: Seccomp: 2, ptrace refused with EPERM, holds still seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.bed.agentkit import AgentProcess, Node, adopted, delete, get, orphans_of_a_killed_exec, wait_for
from tests.bed.controller_harness import install_crds

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "charts" / "sandkeep" / "files" / "agent-seccomp.json"
PTRACE_FAMILY = {"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "process_madvise"}
EPERM, ENOSYS = 1, 38
NOBODY = 65534


def profile() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(PROFILE.read_text())
    return loaded


def allowed() -> set[str]:
    """Every call some rule allows (clone: only without namespace flags, see below)."""
    return {n for rule in profile()["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}


def test_the_ptrace_family_is_refused_with_eperm_and_nothing_else_is_refused_loosely() -> None:
    p = profile()
    assert p["defaultAction"] == "SCMP_ACT_ERRNO" and p["defaultErrnoRet"] == EPERM, "not listed means refused"
    refused = {
        n: rule.get("errnoRet") for rule in p["syscalls"] if rule["action"] != "SCMP_ACT_ALLOW" for n in rule["names"]
    }
    assert refused == {**dict.fromkeys(PTRACE_FAMILY, EPERM), "clone3": ENOSYS}  # ENOSYS: glibc falls back to clone
    assert not PTRACE_FAMILY & allowed()
    assert {r["action"] for r in p["syscalls"]} == {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}


def test_clone_is_allowed_only_without_namespace_flags() -> None:
    (rule,) = [r for r in profile()["syscalls"] if r["names"] == ["clone"]]
    namespaces = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000
    assert rule["args"] == [{"index": 0, "value": namespaces, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]
    assert all(r["names"] == ["clone"] or "args" not in r for r in profile()["syscalls"]), "one conditional rule"


# What the agent never needs: each group would widen what a compromised agent can do.
NEVER = [
    *("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen"),
    *("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "keyctl", "add_key", "request_key"),
    *("init_module", "finit_module", "delete_module", "kexec_load", "reboot", "swapon", "acct", "quotactl"),
    *("open_by_handle_at", "name_to_handle_at", "mknod", "setxattr", "syslog", "personality", "iopl", "ioperm"),
    *("setuid", "setresuid", "setgid", "settimeofday", "clock_settime", "adjtimex"),
]


@pytest.mark.parametrize("call", NEVER)
def test_nothing_that_makes_namespaces_mounts_kernel_objects_or_new_ids_is_allowed(call: str) -> None:
    assert call not in allowed()


def _child_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


def _calls(summary: Path) -> set[str]:
    """The system call names of a `strace -c` table."""
    rows = summary.read_text().splitlines()[2:]  # below the header and its rule
    return {row.split()[-1] for row in rows if row.strip() and not row.startswith("-")} - {"total"}


def _phase(cluster: Any, namespace: str, name: str) -> str | None:
    phase: str | None = ((get(cluster, namespace, name) or {}).get("status") or {}).get("phase")
    return phase


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.slow
def test_every_call_the_agent_makes_doing_its_whole_job_is_allowed_and_none_is_ptrace(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    install_crds(cluster)
    node = Node(cluster, tmp_path, "sc")
    paths = {name: node.retain(namespace, name) for name in ("plain", "cwd", "fd", "orphans", "stuck")}
    holders = [  # another user's processes: reading their /proc entries takes the ptrace access check
        subprocess.Popen(["sleep", "300"], cwd=paths["cwd"] / "workspace", preexec_fn=_as_nobody),
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os,time; f=open({str(paths['fd'] / 'workspace' / 'README')!r}); "
                f"os.setgid({NOBODY}); os.setuid({NOBODY}); time.sleep(300)",
            ]
        ),
    ]
    orphans = orphans_of_a_killed_exec(node, namespace, "orphans", "sleep 200 & sleep 201 & echo ready; exec sleep 202")
    subprocess.run(["chattr", "+i", str(paths["stuck"] / "workspace" / "README")], check=True)
    summary = tmp_path / "agent.strace"
    agent = AgentProcess(
        cluster, node, namespace, tmp_path / "agent.log", wrap=["strace", "-f", "-qq", "-c", "-o", str(summary)]
    )
    try:
        for name in paths:
            adopted(cluster, namespace, name)
            delete(cluster, namespace, name)
        for name in ("cwd", "fd"):
            wait_for(
                lambda n=name: (get(cluster, namespace, n) or {}).get("status", {}).get("phase") == "Held",
                60,
                f"{name} held",
            )
        wait_for(
            lambda: (get(cluster, namespace, "stuck") or {}).get("status", {}).get("phase") == "Stuck", 60, "stuck"
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port()}/metrics", timeout=5) as scrape:
            assert b"sandkeep_" in scrape.read()
        for holder in holders:
            holder.kill()
            holder.wait()
        subprocess.run(["chattr", "-R", "-i", str(node.root.path)], check=True)
        for name in paths:
            wait_for(lambda n=name: get(cluster, namespace, n) is None, 60, f"{name} deleted")
        os.kill(_child_of(agent.proc.pid), signal.SIGTERM)  # the agent itself; strace writes its table at the end
        agent.proc.wait(60)
    finally:
        for holder in holders:
            holder.kill()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["chattr", "-R", "-i", str(node.root.path)], check=False)
        agent.stop()
    calls = _calls(summary)
    # the orphans were signalled through pidfds (pidfd_open, then pidfd_send_signal), never kill(2) by pid
    reaped = {"pidfd_open", "pidfd_send_signal"}
    assert {"openat", "getdents64", "readlink", "renameat2", "unlinkat", *reaped} <= calls, sorted(calls)
    assert not calls & PTRACE_FAMILY, "the agent read other users' /proc entries without a ptrace call"
    # clone3 answers ENOSYS under the profile, and glibc then starts the thread with clone (allowed)
    refused = calls - allowed() - {"clone3"}
    assert refused == set(), f"calls the profile would refuse: {sorted(refused)}"
