"""Warnings before a deadline with a real `sandkeep controller` against the real API server: `warnBefore`'s
condition and Event, and the `warnWebhook` notices against a real receiver, one that fails, one that is down
and one that hangs (neither delays a deletion).

The notices' pure parts are in tests/unit/test_notices.py; the `start` fixture is this folder's
conftest.py, the helpers tests/bed/controller_harness.py.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

from controller.api.kube import Kube
from controller.rules import contracts as c
from controller.rules.durations import Invalid, format_instant, parse_instant
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import (
    condition,
    get,
    get_policy,
    gone,
    metric_value,
    phase_is,
    reasons_for,
    sandbox,
    wait_for,
)


def test_warn_before_gives_a_condition_and_one_event_before_the_deadline(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 3: 10 s before its 20 s deadline the sandbox says ExpiringSoon, in a condition and an Event.
    start("--retention=1h")
    spec = {"retention": "20s", c.WARN_BEFORE: "10s"}
    cluster.apply(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.POLICY_KIND,
            "metadata": {"name": "warn", "namespace": namespace},
            "spec": spec,
        }
    )
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "warn"), "Active"))
    kube.create_sandbox(namespace, sandbox("soon"))
    soon = wait_for(
        "ExpiringSoon", lambda: condition(get(kube, namespace, "soon"), c.Condition.EXPIRING_SOON), timeout=30
    )
    assert soon["status"] == "True" and soon["reason"] == c.Reason.EXPIRING_SOON
    assert get(kube, namespace, "soon")["status"]["phase"] == c.Phase.RETAINED  # type: ignore[index]
    wait_for("the Event", lambda: c.Reason.EXPIRING_SOON in reasons_for(kube, namespace, "soon"))
    wait_for("the sandbox to be deleted", lambda: gone(kube, namespace, "soon"), timeout=30)
    assert reasons_for(kube, namespace, "soon").count(c.Reason.EXPIRING_SOON) == 1


class Receiver:
    """A warnWebhook receiver on loopback: answers 500 to its first `failures` notices, then 200; with `hang`
    it never answers. Keeps every request's path and JSON body."""

    def __init__(self, failures: int = 0, hang: bool = False) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.requests.append((self.path, body))
                if hang:
                    receiver.released.wait(60)
                    return
                self.send_response(500 if len(receiver.requests) <= failures else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/sandkeep?token=s3cret"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def _warn_policy(cluster: LocalCluster, kube: Kube, namespace: str, url: str, retention: str) -> None:
    spec = {"retention": retention, c.WARN_BEFORE: "4s", c.WARN_WEBHOOK: {"url": url}}
    body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": "warn", "namespace": namespace}}
    cluster.apply(body | {"spec": spec})
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "warn"), "Active"))


def _due(kube: Kube, namespace: str, name: str) -> datetime:
    due = parse_instant(phase_is(kube, namespace, name, c.Phase.RETAINED)["deadline"])
    assert not isinstance(due, Invalid)
    return due


def _lateness(kube: Kube, namespace: str, name: str, due: datetime) -> float:
    """Wait for the sandbox to go; return how late it went after its deadline `due`, in seconds."""
    wait_for(f"{name} to be deleted", lambda: gone(kube, namespace, name), timeout=30, interval=0.05)
    return (datetime.now(UTC) - due).total_seconds()


def test_a_warn_webhook_gets_one_notice_retried_past_two_failures(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 3: at ExpiringSoon the policy's webhook gets one JSON notice; a receiver that fails twice
    # gets it on the third attempt (1 s and 2 s later), and the logs name its host, never its path or query.
    receiver = Receiver(failures=2)
    try:
        ctl = start("--retention=1h")
        _warn_policy(cluster, kube, namespace, receiver.url, retention="12s")
        kube.create_sandbox(
            namespace, sandbox("soon", origin={"pod": "p", "outcome": "Succeeded", "labels": {"job-name": "nightly"}})
        )
        due = _due(kube, namespace, "soon")
        wait_for("the notice to be accepted", lambda: len(receiver.requests) >= 3, timeout=30)
        assert _lateness(kube, namespace, "soon", due) < 3
        paths = {path for path, _ in receiver.requests}
        assert paths == {"/hooks/sandkeep?token=s3cret"} and len(receiver.requests) == 3
        notice = receiver.requests[-1][1]
        assert notice["kind"] == c.WARN_NOTICE_KIND == c.Reason.EXPIRING_SOON
        assert (notice["namespace"], notice["name"], notice["node"]) == (namespace, "soon", "node-a")
        assert notice["deadlineSource"] == c.DeadlineSource.WINDOW and notice["deadline"] == format_instant(due)
        assert "within warnBefore" in notice["message"] and notice["origin"]["labels"] == {"job-name": "nightly"}
        text = ctl.metrics()
        assert metric_value(text, c.M_WARN_NOTICES, result=c.NoticeResult.SENT) == 1
        assert metric_value(text, c.M_WARN_NOTICES, result=c.NoticeResult.RETRIED) == 2
        log = ctl.log()
        assert f"host=127.0.0.1:{receiver.server.server_port}" in log and "warn_notice_sent" in log
        assert "s3cret" not in log and "/hooks" not in log
    finally:
        receiver.close()


def test_a_warn_webhook_that_is_down_never_delays_the_deletion(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Nothing listens at the webhook's port: the notice is retried in the background and the sandbox still goes
    # at its deadline.
    receiver = Receiver()
    url = receiver.url
    receiver.close()  # its port now refuses connections
    ctl = start("--retention=1h")
    _warn_policy(cluster, kube, namespace, url, retention="8s")
    kube.create_sandbox(namespace, sandbox("soon"))
    assert _lateness(kube, namespace, "soon", _due(kube, namespace, "soon")) < 3
    assert metric_value(ctl.metrics(), c.M_WARN_NOTICES, result=c.NoticeResult.RETRIED) >= 2
    assert metric_value(ctl.metrics(), c.M_WARN_NOTICES, result=c.NoticeResult.SENT) == 0
    assert "warn_notice_retried" in ctl.log() and "s3cret" not in ctl.log()


def test_a_warn_webhook_that_hangs_is_cut_off_by_the_timeout_and_delays_nothing(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # A receiver that takes the request and never answers: each attempt ends at --warn-webhook-timeout, and
    # the deletion is on time meanwhile.
    receiver = Receiver(hang=True)
    try:
        ctl = start("--retention=1h", "--warn-webhook-timeout=1s")
        _warn_policy(cluster, kube, namespace, receiver.url, retention="8s")
        kube.create_sandbox(namespace, sandbox("soon"))
        due = _due(kube, namespace, "soon")
        wait_for("the first attempt", lambda: receiver.requests, timeout=20)
        asked = time.monotonic()
        wait_for("the second attempt", lambda: len(receiver.requests) >= 2, timeout=10)
        assert time.monotonic() - asked < 1 + 1 + 4  # the timeout, the first backoff, slack (unbounded: 60 s)
        assert _lateness(kube, namespace, "soon", due) < 3
        assert "timed out" in ctl.log() and metric_value(ctl.metrics(), c.M_WARN_NOTICES, result="retried") >= 1
    finally:
        receiver.close()
