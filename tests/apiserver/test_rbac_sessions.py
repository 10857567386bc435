"""The controller's session rules proven on the real API server: the whole of a session (its Pod, Role and
RoleBinding made and torn down) as the chart's controller ServiceAccount, every verb of those rules needed,
and a Pod the controller was refused to delete gone once it may.

The bed (the chart's RBAC installed, the components as its ServiceAccounts, the scenario) is
tests/bed/rbackit.py; the rest of the chart's RBAC is tested in test_rbac.py.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controller.rules import contracts as c
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import metric_value, only_in, render_templates, scrape, wait_for
from tests.bed.rbackit import RBAC_TEMPLATES, Install, Process, Refused, Scenario, rule_verbs, without


# --- the controller's session rules: the whole of a session, as its ServiceAccount ---------------------------
def render_sessions(release: str, namespace: str) -> list[dict[str, Any]]:
    """The chart's RBAC with sessions on."""
    return render_templates(
        release, namespace, (*RBAC_TEMPLATES, "sessions.yaml"), only_in(namespace), "--set=sessions.enabled=true"
    )


def session_role(role: str) -> bool:
    """The controller's session rules: its ClusterRole (sessions, their Pods in any namespace, the guard)."""
    return role == "ClusterRole-controller-sessions"


class SessionScenario(Scenario):
    """A session's whole life as the controller's ServiceAccount sees it: watched, its Pod created in the
    sandbox's own namespace and read, its status written, Running once its Pod runs ready, and its Pod
    deleted when it is deleted. Nothing is granted. No kubelet runs here: the Pod's running state is
    written as the kubelet writes it; the controller's own calls are what is proven."""

    def start(self) -> None:
        controller_args = [
            "controller",
            f"--namespace={self.ns}",
            f"--kubeconfig={self.inst.kubeconfig('controller')}",
            "--metrics-port=0",
            "--lease-duration=5",
            "--sessions",
            "--sessions-image=sandkeep:test",
            f"--sessions-admission-binding={self.inst.release}-sandkeep-sessions",
            f"--watch-namespace={self.ns}",  # this test's sessions only: other tests' are other installs'
        ]
        self.processes.append(Process("controller", controller_args, self.tmp / "controller.log"))

    def run(self) -> None:
        self.cluster.create_node(self.node, ready=True)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        sandbox = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": "look", "namespace": self.ns},
            "spec": {"nodeName": self.node, "createdAt": now},
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(sandbox))
        self.start()
        self.step("the controller to hold its leader Lease", lambda: self._holder(c.CONTROLLER_LEASE))
        self.step("the controller's status on look", lambda: self._phase("look") == "Retained")
        me = self.cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout.strip()
        session = {
            "apiVersion": c.API_VERSION,
            "kind": c.SESSION_KIND,
            "metadata": {"name": "look-1", "namespace": self.ns},
            "spec": {"sandbox": "look", "user": me},
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(session))
        pod = self.step("the session's Pod", self._session_pod)
        self._runs(pod)
        self.step("the session Running", lambda: self._session_phase() == c.SessionPhase.RUNNING)
        name = pod["metadata"]["name"]
        assert not self.get("rolebindings", name) and not self.get("roles", name), "nothing is granted"
        self.cluster.kubectl("delete", c.SESSION_PLURAL, "look-1", "-n", self.ns)
        self.step("the Pod deleted", lambda: self._torn_down(name))
        if refused := self.refusals():
            raise Refused(f"after the last step: refused: {refused[0][:400]}")

    def stop(self) -> None:
        super().stop()
        # No kubelet finishes a Pod's graceful deletion here: remove them outright, so the namespace can go.
        self.cluster.kubectl("delete", "pods", "--all", "-n", self.ns, "--grace-period=0", "--force", check=False)

    def _torn_down(self, name: str) -> bool:
        pod = self.get("pods", name)
        return pod is None or "deletionTimestamp" in pod["metadata"]

    def _session_phase(self) -> str | None:
        status = (self.get(c.SESSION_PLURAL, "look-1") or {}).get("status") or {}
        if status.get("phase") in (c.SessionPhase.REFUSED, c.SessionPhase.ENDED):
            raise Refused(f"the session {status['phase']}: {status.get('reason')}: {status.get('message')}")
        phase: str | None = status.get("phase")
        return phase

    def _session_pod(self) -> dict[str, Any] | None:
        self._session_phase()
        name = ((self.get(c.SESSION_PLURAL, "look-1") or {}).get("status") or {}).get("podName")
        return self.get("pods", name) if name else None

    def _runs(self, pod: dict[str, Any]) -> None:
        """What the kubelet reports of a started Pod whose volumes (the sandbox's, by the plugin) mounted."""
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        container = {
            "name": c.SESSION_CONTAINER,
            "image": "sandkeep:test",
            "imageID": "",
            "ready": True,
            "restartCount": 0,
            "containerID": f"containerd://{secrets.token_hex(32)}",
            "state": {"running": {"startedAt": started}},
        }
        status = {"status": {"phase": "Running", "containerStatuses": [container]}}
        name = pod["metadata"]["name"]
        self.cluster.kubectl(
            "patch", "pod", name, "-n", self.ns, "--subresource=status", "--type=merge", "-p", json.dumps(status)
        )


@pytest.mark.slow
def test_the_controller_runs_a_whole_session_as_the_charts_serviceaccount(
    install: Callable[..., Install], namespace: str, tmp_path: Path
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    run = SessionScenario(install(render_sessions(release, namespace), release=release), tmp_path)
    try:
        run.run()
    except Refused as err:
        raise AssertionError(f"{err}\n{run.processes[0].log()[-3000:]}") from None
    finally:
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("role", "index", "verb"), rule_verbs(render_sessions("x", "ns"), session_role))
def test_every_verb_of_the_controllers_session_rules_is_needed(
    install: Callable[..., Install], namespace: str, tmp_path: Path, role: str, index: int, verb: str
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    run = SessionScenario(
        install(without(render_sessions(release, namespace), role, index, verb), release=release), tmp_path
    )
    try:
        with pytest.raises(Refused) as refused:
            run.run()
    finally:
        run.stop()
    print(f"without {role} rule {index} verb {verb}: {refused.value}")


@pytest.mark.slow
def test_a_pod_the_controller_was_refused_to_delete_goes_once_it_may(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    full = render_sessions(release, namespace)
    name = f"{release}-sandkeep-controller-sessions"
    (role,) = [d for d in full if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    pods = next(i for i, rule in enumerate(role["rules"]) if rule["resources"] == ["pods"])
    inst = install(without(full, "ClusterRole-controller-sessions", pods, "delete"), release=release)
    run = SessionScenario(inst, tmp_path)
    try:
        with pytest.raises(Refused, match="pods"):
            run.run()
        assert run.get(c.SESSION_PLURAL, "look-1") is None, "the session is deleted; its Pod is what is left"

        def left() -> list[dict[str, Any]]:
            items = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", c.LABEL_SESSION_UID)["items"]
            return [p for p in items if "deletionTimestamp" not in p["metadata"]]

        assert left(), "the refused teardown left the Pod"
        cluster.apply([role])  # the verb given back: the worker's retry deletes the Pod
        wait_for("the Pod deleted", lambda: not left() or None, timeout=60)
        assert "retry_in" in run.processes[0].log()
        text = scrape(run.processes[0].log)  # the refusals counted, in controller-runtime's names and sandkeep's
        sessions = {"controller": c.Queue.SESSIONS}
        errors = metric_value(text, c.M_RECONCILE_ERRORS_TOTAL, **sessions)
        assert errors >= 1
        assert errors == metric_value(text, c.M_RECONCILE_TOTAL, **sessions, result=c.ReconcileResult.ERROR)
        assert errors == metric_value(text, c.M_RECONCILE_ERRORS, component=c.Queue.SESSIONS)
    finally:
        run.stop()
