"""The chart's security shape, rendered by the real helm with no server: the agent's capabilities and seccomp
profile, the CSI plugin's privilege, the controller as non-root, and the RBAC the chart grants (the agent's
role, the node-scope and pin policies, the aggregated roles). The same RBAC on the real API server is
tests/apiserver/test_rbac.py's.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from controller.rules import contracts as c
from controller.rules.durations import MAX_DURATION, MAX_INSTANT, MIN_INSTANT, format_instant
from controller.rules.models import NAME_MAX
from tests.bed.chart import CHART, find, objects, render, values_docs
from tests.bed.controller_harness import only_in


# --- security context and RBAC shape ---------------------------------------------------------------------
def test_agent_drops_every_capability_and_adds_back_only_four_each_justified(tools: Path) -> None:
    ds = find(objects(render(tools)), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    container = pod["containers"][0]
    sc = container["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == ["DAC_OVERRIDE", "FOWNER", "KILL", "SYS_PTRACE"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and not sc["privileged"]
    assert sc["appArmorProfile"] == {"type": "Unconfined"}  # the default profile hides other processes' /proc
    node_env = next(e for e in container["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--node=$(NODE_NAME)" in container["args"]
    root = next(v for v in pod["volumes"] if v["name"] == "root")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "root")
    assert root["hostPath"]["path"] == mount["mountPath"] == "/var/lib/sandkeep"
    # each added capability is justified in the documentation of agent.securityContext (the values table)
    doc = values_docs()[("agent", "securityContext")]
    for cap in sc["capabilities"]["add"]:
        assert re.search(rf"\b{cap} [a-z]", doc), f"capability {cap} has no sentence saying why"


def test_the_agent_runs_under_the_charts_seccomp_profile_installed_by_its_init_container(tools: Path) -> None:
    docs = objects(render(tools, "--set=agent.seccomp.kubeletRootDir=/data/kubelet/"))
    pod = find(docs, "DaemonSet")["spec"]["template"]
    profile = (CHART / "files" / "agent-seccomp.json").read_text()
    assert find(docs, "ConfigMap", "-agent-seccomp")["data"] == {"sk-sandkeep-agent.json": profile}
    agent, init = pod["spec"]["containers"][0], pod["spec"]["initContainers"][0]
    assert agent["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "sandkeep/sk-sandkeep-agent.json",
    }
    assert "sandkeep/sk-sandkeep-agent.json.tmp /host-seccomp/sandkeep/sk-sandkeep-agent.json" in init["command"][2]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kubelet-seccomp"]["hostPath"] == {"path": "/data/kubelet/seccomp", "type": "DirectoryOrCreate"}
    assert {m["name"] for m in init["volumeMounts"]} == {"seccomp-profile", "kubelet-seccomp"}
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "kubelet-seccomp" not in {m["name"] for m in agent["volumeMounts"]}, "the agent cannot rewrite its profile"
    # a new profile rolls the agents, each new Pod installing it before its agent starts
    assert pod["metadata"]["annotations"]["checksum/seccomp"] == hashlib.sha256(profile.encode()).hexdigest()


def test_without_the_seccomp_profile_the_agent_keeps_the_runtime_default(tools: Path) -> None:
    docs = objects(render(tools, "--set=agent.seccomp.enabled=false", "--set=agent.podAnnotations.team=ci"))
    pod = find(docs, "DaemonSet")["spec"]["template"]
    assert not [d for d in docs if d["kind"] == "ConfigMap"] and "initContainers" not in pod["spec"]
    assert "seccompProfile" not in pod["spec"]["containers"][0]["securityContext"]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["metadata"]["annotations"] == {"team": "ci"}


def test_the_csi_driver_is_the_contracts_and_only_its_plugin_container_is_privileged(tools: Path) -> None:
    from controller.cli import sandkeep

    docs = objects(render(tools, "--set=csi.kubeletDir=/data/kubelet/"))
    driver = find(docs, "CSIDriver")
    assert driver["metadata"]["name"] == c.CSI_DRIVER
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"] and driver["spec"]["fsGroupPolicy"] == "File"
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    containers = {k["name"]: k for k in pod["containers"]}
    assert list(containers) == ["agent", "csi", "csi-registrar"]
    assert not containers["agent"]["securityContext"]["privileged"]
    assert containers["csi"]["securityContext"]["privileged"] is True
    registrar = containers["csi-registrar"]["securityContext"]
    assert registrar["capabilities"]["drop"] == ["ALL"] and registrar["allowPrivilegeEscalation"] is False
    # Only the kubelet's directory propagates mounts back to the host, and only from the plugin.
    propagating = {
        (name, m["mountPath"])
        for name, k in containers.items()
        for m in k["volumeMounts"]
        if m.get("mountPropagation") == "Bidirectional"
    }
    assert propagating == {("csi", "/data/kubelet")}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert paths["csi-socket"] == f"/data/kubelet/plugins/{c.CSI_DRIVER}"
    assert paths["registration"] == "/data/kubelet/plugins_registry"
    args = containers["csi-registrar"]["args"]
    assert f"--kubelet-registration-path=/data/kubelet/plugins/{c.CSI_DRIVER}/csi.sock" in args
    # Both containers' args go through the real command line, as the agent's do.
    for name, command in (("csi", "csi-node"), ("csi-registrar", "csi-registrar")):
        argv = [a.replace("$(NODE_NAME)", "node-a") for a in containers[name]["args"]]
        parsed = sandkeep._parser(command).parse_args(argv)
        assert parsed.command == command
    node_args = sandkeep._parser("csi-node").parse_args(containers["csi"]["args"])
    assert node_args.kubelet_dir == "/data/kubelet" and node_args.endpoint == "/csi/csi.sock"
    off = objects(render(tools, "--set=csi.enabled=false"))
    assert not [d for d in off if d["kind"] == "CSIDriver"]
    assert [k["name"] for k in find(off, "DaemonSet")["spec"]["template"]["spec"]["containers"]] == ["agent"]


def test_controller_runs_as_non_root_without_capabilities(tools: Path) -> None:
    pod = find(objects(render(tools)), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = pod["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert not pod.get("hostPID") and not any("hostPath" in v for v in pod["volumes"])


def test_agent_role_deletes_only_sandboxes_reads_no_secrets_and_grants_nothing(tools: Path) -> None:
    docs = objects(render(tools))
    rules = find(docs, "ClusterRole", "-agent")["rules"] + find(docs, "Role", "-agent-leases")["rules"]
    for rule in rules:
        # delete: releasing its own node's sandboxes for space (the node-scope policy holds it to its node)
        if "delete" in rule["verbs"]:
            assert rule["apiGroups"] == [c.GROUP] and rule["resources"] == [c.SANDBOX_PLURAL], rule
        assert "deletecollection" not in rule["verbs"] and "*" not in rule["verbs"]
        assert "secrets" not in rule["resources"] and "*" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"]


def test_agent_node_scope_policy_uses_the_contracts_lease_prefix(tools: Path) -> None:
    policy = find(objects(render(tools)), "ValidatingAdmissionPolicy", "-agent-node-scope")
    lease = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "lease")
    # leases.heartbeat_name, as CEL (tests/apiserver/test_rbac.py shows both on the API server with a 253-char node)
    prefixed = f"'{c.AGENT_LEASE_PREFIX}' + variables.node"
    assert lease == f"size({prefixed}) <= {NAME_MAX} ? {prefixed} : variables.node"
    node_rule = next(v["expression"] for v in policy["spec"]["validations"] if "leaseNode" in v["expression"])
    assert f"annotations[?'{c.LABEL_NODE}']" in node_rule
    agent = "system:serviceaccount:sandkeep:sk-sandkeep-agent"
    assert policy["spec"]["matchConditions"][0]["expression"] == f'request.userInfo.username == "{agent}"'


def test_pin_policy_reads_the_contracts_keys_and_bounds_and_spares_the_charts_serviceaccounts(tools: Path) -> None:
    # tests/apiserver/test_admission.py proves the CEL against durations.py on the API server; this ties the names.
    values = ("--set=controller.serviceAccount.name=ctl", "--set=agent.serviceAccount.name=agt")
    policy = find(objects(render(tools, *values)), "ValidatingAdmissionPolicy", "-pins")
    expressions = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert expressions["changed"].startswith(f"['{c.ANN_PIN_UNTIL}', '{c.ANN_PIN_FOR}']")
    latest = format_instant(MAX_INSTANT).replace("Z", ".000000999Z")  # Python keeps microseconds only
    assert f"timestamp('{format_instant(MIN_INSTANT)}')" in expressions["instantInRange"]
    assert f"timestamp('{latest}')" in expressions["instantInRange"]
    too_large = next(v for v in policy["spec"]["validations"] if "too large" in v["messageExpression"])
    assert f"<= {int(MAX_DURATION.total_seconds())})" in too_large["expression"]
    assert f"at most {MAX_DURATION.days}d" in too_large["messageExpression"]
    users = '["system:serviceaccount:sandkeep:ctl","system:serviceaccount:sandkeep:agt"]'
    assert policy["spec"]["matchConditions"][0]["expression"] == f"!(request.userInfo.username in {users})"


def test_pin_policy_turns_off_and_binds_only_the_namespaces_asked(tools: Path) -> None:
    assert not [
        d for d in objects(render(tools, "--set=admission.pinPolicy=false")) if d["metadata"]["name"].endswith("-pins")
    ]
    assert "matchResources" not in find(objects(render(tools)), "ValidatingAdmissionPolicyBinding", "-pins")["spec"]
    binding = find(objects(render(tools, only_in("team-a"))), "ValidatingAdmissionPolicyBinding", "-pins")
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    assert binding["spec"]["matchResources"] == {"namespaceSelector": selector}


def test_aggregated_roles_carry_the_aggregation_labels(tools: Path) -> None:
    docs = objects(render(tools))
    view, edit = find(docs, "ClusterRole", "-view"), find(docs, "ClusterRole", "-edit")
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in view["rules"])
    assert {v for r in edit["rules"] for v in r["verbs"]} == {"get", "list", "watch", "patch", "update", "delete"}
    assert all("retainedsandboxes/status" not in r["resources"] for r in edit["rules"])
