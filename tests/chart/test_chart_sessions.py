"""The chart's sessions (issue 25), rendered by the real helm with no server: the bounds named once in
contracts.py, from the values to the controller and the policy, and the policy that guards a session.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from controller.rules import contracts as c
from tests.bed.chart import CHART, container_of, find, objects, render, values_docs

# --- sessions (issue 25): bounds named once in contracts.py, from the values to the controller and the policy ----
SESSIONS_ON = "--set=sessions.enabled=true"


def test_session_bounds_are_the_contracts_defaults_and_reach_the_controller_as_it_parses_them(tools: Path) -> None:
    from controller.cli import sandkeep
    from controller.cluster.main import settings_from
    from controller.cluster.session_decide import DEFAULT_RESOURCES

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sessions = values["sessions"]
    docs = values_docs()
    for bound in (c.SESSIONS_MAX_PER_USER, c.SESSIONS_MAX_PER_NAMESPACE, c.SESSIONS_MIN_OWNER_ID):
        assert sessions[bound.value] == bound.default, bound
    for value in (c.SESSIONS_MAX_PER_USER.value, c.SESSIONS_MAX_PER_NAMESPACE.value):
        assert c.Reason.SESSION_LIMIT in docs[("sessions", value)]
    assert c.Reason.IMAGE_NOT_ALLOWED in docs[("sessions", "allowedImages")]
    assert sessions["resources"] == DEFAULT_RESOURCES and sessions["runAsUser"] == c.NOBODY
    assert sessions["allowedImages"] == []
    tolerations = ('--set-json=agent.tolerations=[{"key":"dedicated","operator":"Exists","effect":"NoExecute"}]',)
    extra = ("--set=sessions.allowedImages={busybox:1.36,alpine:3.20}", "--set=sessions.maxPerUser=1", *tolerations)
    for given in ((), extra):
        args = container_of(find(objects(render(tools, SESSIONS_ON, *given)), "Deployment"))["args"]
        assert any(a.startswith(c.SESSIONS_RESOURCES + "=") for a in args)
        assert any(a.startswith(c.SESSIONS_TOLERATIONS + "=") for a in args)
        session = settings_from(sandkeep._parser("controller").parse_args(args)).session_settings()
        assert session is not None
        assert session.resources == DEFAULT_RESOURCES and session.min_owner_id == c.SESSIONS_MIN_OWNER_ID.default
        assert session.policy_name == session.admission_binding == "sk-sandkeep-sessions"
        if given:
            assert session.allowed_images == ("busybox:1.36", "alpine:3.20") and session.max_per_user == 1
            assert session.tolerations == ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"},)
        else:
            assert session.allowed_images == () and session.tolerations == ({"operator": "Exists"},)
            assert session.max_per_user == c.SESSIONS_MAX_PER_USER.default
            assert session.max_per_namespace == c.SESSIONS_MAX_PER_NAMESPACE.default


def test_the_sessions_policy_proves_the_user_and_admits_only_the_allowed_images(tools: Path) -> None:
    docs = objects(render(tools, SESSIONS_ON, "--set=sessions.allowedImages={busybox:1.36}"))
    policy = find(docs, "ValidatingAdmissionPolicy", "-sessions")
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert c.SESSION_USER_CHECK in [v["expression"] for v in policy["spec"]["validations"]]
    images = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "images")
    default = container_of(find(docs, "Deployment"))["image"]
    assert json.loads(images) == [default, "busybox:1.36"]  # the default first, always allowed
    binding = find(docs, "ValidatingAdmissionPolicyBinding", "-sessions")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_the_controller_reads_only_its_own_sessions_guard(tools: Path) -> None:
    role = find(objects(render(tools, SESSIONS_ON)), "ClusterRole", "-controller-sessions")
    guard = [r for r in role["rules"] if r["apiGroups"] == ["admissionregistration.k8s.io"]]
    assert guard == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": [kind],
            "resourceNames": ["sk-sandkeep-sessions"],
            "verbs": ["get"],
        }
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies")
    ]


def test_sessions_need_no_namespace_of_their_own_and_the_removed_values_are_still_accepted(tools: Path) -> None:
    # An upgrade with --reuse-values still carries sessions.namespace and createNamespace: accepted, ignored.
    old = ("--set=sessions.namespace=sk-sessions", "--set=sessions.createNamespace=true")
    docs = objects(render(tools, SESSIONS_ON, *old))
    assert not [d for d in docs if d["kind"] == "Namespace"]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and "sessions" in d["metadata"]["name"]]
    assert "sk-sessions" not in json.dumps(docs)
    assert "--sessions" in container_of(find(docs, "Deployment"))["args"]
    role = find(docs, "ClusterRole", "-controller-sessions")
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]} in role["rules"]
    assert not [r for r in role["rules"] if r["apiGroups"] == ["rbac.authorization.k8s.io"]]
    assert not any("exec" in res for r in role["rules"] for res in r["resources"])
