"""The chart's RBAC proven on the real API server: the components do their whole job as the chart's
ServiceAccounts (real TokenRequest tokens, never admin), every rule is needed, and nobody gets more.

`helm template` renders the ServiceAccounts, (Cluster)Roles and bindings of a uniquely named release into
the test's namespace; they are applied to the local control plane; a real `sandkeep controller` and a
real `sandkeep agent` run with kubeconfigs holding their ServiceAccounts' tokens. The scenario: the agent
adopts directories (with its finalizer) and renews its heartbeat; the controller takes its leader Lease,
writes status, converts a `pin-for`, deletes an expired sandbox (the agent then removes it from disk and
drops its finalizer), releases a sandbox of a vanished node and marks a SandboxPolicy Active. The
rule-removal tests take one verb of one rule away at a time and show the scenario then hits a refusal.
The bed (`Install`, `Process`, `Scenario`) is tests/bed/rbackit.py, the `install` fixture this folder's
conftest.py; the controller's session rules are tested in test_rbac_sessions.py.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controller.api.kube import Kube, KubeError, load_config
from controller.api.leases import heartbeat_name, read_lease, renew_heartbeat
from controller.node.inuse import uninspectable_pids
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules.models import NAME_MAX, bounded_name
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import wait_for
from tests.bed.rbackit import (
    _FORBIDDEN,
    Install,
    Process,
    Refused,
    Scenario,
    component_role,
    render_rbac,
    rule_verbs,
    without,
)

# Verbs the scenario cannot make a component use deterministically, each with the code path that uses it;
# the test checks that path still exists (if it goes, so must the verb).
NOT_REACHED_BY_THE_SCENARIO = {
    "ClusterRole-agent:retainedsandboxes:get": (
        ("controller.agent", "Agent._finish"),
        "get_sandbox",
        "the fresh read after a 409 on finalizer removal needs a write racing that removal",
    ),
    "ClusterRole-agent:retainedsandboxes:delete": (
        ("controller.agent.relief", "Relief._release_one"),
        "delete_sandbox",
        "releasing for space needs a full disk: tests/node/test_nodes.py fills a real node's small disk",
    ),
}


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Callable[[Install], Scenario]]:
    made: list[Scenario] = []

    def make(inst: Install) -> Scenario:
        made.append(Scenario(inst, tmp_path))
        return made[-1]

    yield make
    for s in made:
        s.stop()


# --- the tests ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_controller_and_agent_do_their_whole_job_as_the_charts_serviceaccounts(
    install: Callable[..., Install], scenario: Callable[[Install], Scenario]
) -> None:
    run = scenario(install())
    try:
        run.run()
    except Refused as err:
        logs = "\n".join(f"----- {p.name}\n{p.log()[-3000:]}" for p in run.processes)
        raise AssertionError(f"{err}\n{logs}") from None


@pytest.mark.slow
@pytest.mark.parametrize(("role", "index", "verb"), rule_verbs(render_rbac("x", "ns"), component_role))
def test_every_verb_of_every_rule_is_needed(
    request: pytest.FixtureRequest,
    install: Callable[..., Install],
    scenario: Callable[[Install], Scenario],
    namespace: str,
    role: str,
    index: int,
    verb: str,
) -> None:
    label = request.node.callspec.id
    if label in NOT_REACHED_BY_THE_SCENARIO:
        (module, qualname), call, why = NOT_REACHED_BY_THE_SCENARIO[label]
        target = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        assert call in inspect.getsource(target), f"{qualname} no longer calls {call} ({why}): drop {label}"
        return
    release = f"rb{secrets.token_hex(3)}"
    inst = install(without(render_rbac(release, namespace), role, index, verb), release=release)
    run = scenario(inst)
    with pytest.raises(Refused) as refused:
        run.run()
    print(f"without {role} rule {index} verb {verb}: {refused.value}")


# --- what nobody may do, and what people may do -------------------------------------------------------------
def can_i(cluster: LocalCluster, kubeconfig: Path | None, *args: str, as_user: str | None = None) -> bool:
    """`kubectl auth can-i` as the holder of `kubeconfig` (a real ServiceAccount token) or as `as_user`."""
    result = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, as_user=as_user, check=False)
    return result.stdout.strip() == "yes"


def test_the_agent_deletes_no_other_object_reads_no_secrets_and_cannot_escalate(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    inst = install()
    agent = inst.kubeconfig("agent")
    # what it needs, so the refusals below are about rights and not a broken token
    for needed in (
        ("create", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("patch", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("delete", "retainedsandboxes.sandkeep.io", "-n", namespace),  # its own node's only: the node-scope policy
        ("list", "pods", "--all-namespaces"),  # also how a captured volume's Pod ended: no get on Pods needed
        ("create", "events", "-n", namespace),  # also on a Pod whose workspace was kept or not (WorkspaceKept...)
        ("update", "leases.coordination.k8s.io", "-n", namespace),
    ):
        assert can_i(cluster, agent, *needed), f"the agent cannot {needed}"
    for refused in (
        ("deletecollection", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("delete", "pods", "-n", namespace),
        ("delete", "leases.coordination.k8s.io", "-n", namespace),
        ("delete", "namespaces"),
        ("delete", "nodes"),
        ("get", "secrets", "-n", namespace),
        ("list", "secrets", "--all-namespaces"),
        ("get", "configmaps", "-n", namespace),
        ("get", "pods", "-n", namespace),  # capture reads its node's Pods from the list, never one by one
        ("create", "pods", "-n", namespace),
        ("patch", "nodes"),
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", namespace),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("bind", "clusterroles.rbac.authorization.k8s.io"),
        ("impersonate", "users"),
        ("create", "serviceaccounts/token", "-n", namespace),
        ("patch", "sandboxpolicies.sandkeep.io", "-n", namespace),
    ):
        assert not can_i(cluster, agent, *refused), f"the agent can {refused}"
    # and the API server really refuses, not only the review
    cluster.kubectl("create", "configmap", "not-yours", "-n", namespace)
    result = cluster.kubectl("delete", "configmap", "not-yours", "-n", namespace, kubeconfig=agent, check=False)
    assert result.returncode != 0 and "forbidden" in result.stderr
    result = cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=agent, check=False)
    assert result.returncode != 0 and "forbidden" in result.stderr


def test_the_controller_cannot_create_sandboxes_read_secrets_or_escalate(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    controller = install().kubeconfig("controller")
    assert can_i(cluster, controller, "delete", "retainedsandboxes.sandkeep.io", "-n", namespace)
    for refused in (
        ("create", "retainedsandboxes.sandkeep.io", "-n", namespace),  # adoption is the agent's
        ("get", "secrets", "-n", namespace),
        ("delete", "pods", "-n", namespace),
        ("update", "leases.coordination.k8s.io/sandkeep-agent-node-a", "-n", namespace),  # not its heartbeat
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", namespace),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("patch", "sandboxpolicies.sandkeep.io", "-n", namespace),
    ):
        assert not can_i(cluster, controller, *refused), f"the controller can {refused}"


def aggregated(cluster: LocalCluster, builtin: str, ours: str) -> bool:
    """Whether kube-controller-manager's clusterrole-aggregation controller has folded every rule of
    ClusterRole `ours` into the built-in ClusterRole `builtin`."""
    rules = cluster.kubectl_json("get", "clusterrole", builtin).get("rules") or []
    return all(rule in rules for rule in cluster.kubectl_json("get", "clusterrole", ours).get("rules") or [])


@pytest.fixture
def other_namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-other-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_a_namespace_editor_can_pin_in_their_namespace_and_not_in_another(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, other_namespace: str
) -> None:
    # The chart's -view and -edit ClusterRoles reach people through the built-in view/edit/admin roles,
    # aggregated by the real controller (view nests into edit, edit into admin).
    inst = install()
    for builtin, ours in (("view", "view"), ("edit", "view"), ("edit", "edit"), ("admin", "edit")):
        wait_for(
            f"the chart's -{ours} rules aggregated into {builtin}",
            lambda b=builtin, o=ours: aggregated(cluster, b, f"{inst.release}-sandkeep-{o}"),
            timeout=30,
        )
    editor, viewer = f"alice-{secrets.token_hex(2)}", f"bob-{secrets.token_hex(2)}"
    cluster.kubectl("create", "rolebinding", "alice-edits", "--clusterrole=edit", f"--user={editor}", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "bob-views", "--clusterrole=view", f"--user={viewer}", "-n", namespace)
    for ns in (namespace, other_namespace):
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": "run-42", "namespace": ns},
            "spec": {"nodeName": "node-a", "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
        cluster.kubectl("create", "-f", "-", input=json.dumps(body))

    def kubectl_as(user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(*args, as_user=user, check=False)

    pin = ("annotate", "rsb", "run-42", f"{c.ANN_PIN_FOR}=72h")
    assert kubectl_as(editor, *pin, "-n", namespace).returncode == 0
    assert cluster.kubectl_json("get", "rsb", "run-42", "-n", namespace)["metadata"]["annotations"][c.ANN_PIN_FOR]
    refused = kubectl_as(editor, *pin, "-n", other_namespace)
    assert refused.returncode != 0 and "forbidden" in refused.stderr
    assert kubectl_as(editor, "annotate", "rsb", "run-42", f"{c.ANN_PIN_FOR}-", "-n", namespace).returncode == 0
    # status is the components' alone: no phase, and no record of when a pin was first seen (the maxPin cap's
    # reference), can be forged by an editor
    for forged in (
        {"phase": "Pinned"},
        {"pinSeen": {"pinUntil": "2099-01-01T00:00:00Z", "at": "2099-01-01T00:00:00Z"}},
    ):
        body = json.dumps({"status": forged})
        status = kubectl_as(
            editor, "patch", "rsb", "run-42", "-n", namespace, "--subresource=status", "--type=merge", "-p", body
        )
        assert status.returncode != 0 and "forbidden" in status.stderr, "status is the components' alone"
    # a viewer lists and reads, and cannot pin
    assert "run-42" in kubectl_as(viewer, "get", "rsb", "-n", namespace).stdout
    assert kubectl_as(viewer, "get", "sandboxpolicies", "-n", namespace).returncode == 0
    viewer_pin = kubectl_as(viewer, *pin, "-n", namespace)
    assert viewer_pin.returncode != 0 and "forbidden" in viewer_pin.stderr
    assert kubectl_as(viewer, "get", "rsb", "-n", other_namespace).returncode != 0
    # the editor may delete one now, in their namespace only
    assert kubectl_as(editor, "delete", "rsb", "run-42", "-n", other_namespace).returncode != 0
    assert kubectl_as(editor, "delete", "rsb", "run-42", "-n", namespace, "--wait=false").returncode == 0


def node_scope_in_force(cluster: LocalCluster, namespace: str, agent: Path) -> None:
    """A new admission policy takes a moment to load: wait until the node-scope policy refuses this agent a
    Lease that is not its heartbeat (deleted again each time it was still admitted)."""
    name = f"not-a-heartbeat-{secrets.token_hex(3)}"
    probe = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}
    deadline = time.monotonic() + 20
    create = ("create", "-n", namespace, "-f", "-")
    while cluster.kubectl(*create, input=json.dumps(probe), kubeconfig=agent, check=False).returncode == 0:
        cluster.kubectl("delete", "lease", name, "-n", namespace, "--wait=false")
        assert time.monotonic() < deadline, "the agent node-scope policy never took effect"
        time.sleep(0.3)


def test_an_agent_writes_only_its_own_nodes_sandboxes_and_heartbeat(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    # RBAC lets the agent write any RetainedSandbox and any Lease of the lease namespace; the chart's
    # ValidatingAdmissionPolicy narrows that to its own node, read from its pod-bound token.
    inst = install()
    mine, other = f"scope-a-{secrets.token_hex(3)}", f"scope-b-{secrets.token_hex(3)}"
    for node in (mine, other):
        cluster.create_node(node)
    agent = inst.agent_kubeconfig(mine)

    def sandbox(name: str, node: str) -> dict[str, Any]:
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeName": node, "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        }

    def lease(name: str, node: str = mine) -> dict[str, Any]:
        meta = {"name": name, "namespace": namespace, "annotations": {c.LABEL_NODE: node}}
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {}}

    def create(obj: dict[str, Any], kubeconfig: Path | None = agent) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("create", "-f", "-", input=json.dumps(obj), kubeconfig=kubeconfig, check=False)

    node_scope_in_force(cluster, namespace, agent)
    result = create(sandbox("theirs", other))
    assert result.returncode != 0
    assert f"may only write RetainedSandboxes of its own node; theirs is on node {other}" in result.stderr
    assert create(sandbox("ours", mine)).returncode == 0
    assert create(lease(f"{c.AGENT_LEASE_PREFIX}{mine}")).returncode == 0
    for name in (f"{c.AGENT_LEASE_PREFIX}{other}", c.CONTROLLER_LEASE):
        refused = create(lease(name))
        assert refused.returncode != 0 and "may only write its own heartbeat Lease" in refused.stderr, name
    # its own Lease's name, but saying it is another node's heartbeat: refused
    own = f"{c.AGENT_LEASE_PREFIX}{mine}"
    refused = create(lease(own, node=other))
    assert f'sandkeep.io/node annotation names that node; {own} names "{other}"' in refused.stderr
    # a token not bound to a pod names no node: refused, however the object looks
    unbound = create(sandbox("unbound", mine), kubeconfig=inst.kubeconfig("agent"))
    assert unbound.returncode != 0 and "names no node" in unbound.stderr
    # the policy is about the agent only: others (here admin) still create sandboxes anywhere
    assert create(sandbox("admins", other), kubeconfig=None).returncode == 0
    # a release for space deletes its own node's sandbox, never another node's
    delete = ("delete", c.SANDBOX_PLURAL, "-n", namespace, "--wait=false")
    refused = cluster.kubectl(*delete, "admins", kubeconfig=agent, check=False)
    assert f"may only write RetainedSandboxes of its own node; admins is on node {other}" in refused.stderr
    assert cluster.kubectl(*delete, "ours", kubeconfig=agent, check=False).returncode == 0


def test_the_agent_of_a_node_with_a_253_character_name_keeps_its_own_heartbeat_and_no_other(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    # `sandkeep-agent-` + a node name over 238 characters is no object name: that heartbeat is named after
    # the node alone, a name the node-scope policy computes too (it used to admit only prefix + node).
    inst = install()
    part = secrets.token_hex(32)[:63]
    node = ".".join([part, part[::-1], part, part[:61]])
    assert len(node) == NAME_MAX and heartbeat_name(node) == node
    cluster.create_node(node, ready=True)
    agent = inst.agent_kubeconfig(node)
    Root(tmp_path / "root")
    args = ["agent", f"--node={node}", f"--root={tmp_path / 'root'}", f"--namespace={namespace}"]
    args += [f"--kubeconfig={agent}", "--metrics-port=0", "--scan-interval=1s"]
    process = Process("agent", [*args, *(f"--ignore-pid={pid}" for pid in uninspectable_pids())], tmp_path / "a.log")

    def lease(name: str) -> dict[str, Any]:
        found = cluster.kubectl("get", "lease", name, "-n", namespace, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else {"metadata": {}, "spec": {}}

    def renewed_with_report() -> bool:  # the create, a renewal (PUT) and the report (PATCH) all admitted
        got = lease(node)
        return c.ANN_ORPHAN_TOMBSTONES in (got["metadata"].get("annotations") or {}) and got["spec"].get(
            "renewTime"
        ) != got["spec"].get("acquireTime")

    try:
        wait_for("the agent's heartbeat, renewed, with its report", renewed_with_report, timeout=40)
        assert lease(node)["metadata"]["annotations"][c.LABEL_NODE] == node
        assert not _FORBIDDEN.search(process.log()), process.log()[-2000:]
    finally:
        process.stop()
    # the name the chart used to admit (cut to fit), the hashed one leases.py used to make: both refused
    for name in (f"{c.AGENT_LEASE_PREFIX}{node}"[:NAME_MAX], bounded_name(c.AGENT_LEASE_PREFIX, node)):
        meta = {"name": name, "namespace": namespace, "annotations": {c.LABEL_NODE: node}}
        body = json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {}})
        refused = cluster.kubectl("create", "-f", "-", input=body, kubeconfig=agent, check=False).stderr
        assert f"may only write its own heartbeat Lease {node}, not {name}" in refused, refused


def test_two_nodes_sharing_a_heartbeat_name_cannot_renew_each_others(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    # The one collision of the name scheme: node X (238 characters or fewer) and a node named
    # `sandkeep-agent-X`. The first heartbeat's node annotation says whose the Lease is.
    inst = install()
    short = f"{secrets.token_hex(3)}.{'s' * (NAME_MAX - len(c.AGENT_LEASE_PREFIX) - 7)}"
    long = f"{c.AGENT_LEASE_PREFIX}{short}"
    assert len(long) == NAME_MAX and heartbeat_name(short) == heartbeat_name(long) == long
    kubeconfigs = {}
    for n in (short, long):
        cluster.create_node(n, ready=True)
        kubeconfigs[n] = inst.agent_kubeconfig(n)
    node_scope_in_force(cluster, namespace, kubeconfigs[short])
    clients = {n: Kube(load_config(kubeconfig), "sandkeep-test") for n, kubeconfig in kubeconfigs.items()}
    try:
        renew_heartbeat(clients[short], namespace, short, "agent-short")
        with pytest.raises(KubeError) as refused:
            renew_heartbeat(clients[long], namespace, long, "agent-long")
        assert refused.value.status == 403
        assert f'sandkeep.io/node annotation names that node; {long} names "{short}"' in refused.value.message
        renew_heartbeat(clients[short], namespace, short, "agent-short")  # still its own to renew
        state = read_lease(clients[short], namespace, long)
        assert state is not None and state.holder == "agent-short"
    finally:
        for client in clients.values():
            client.close()
