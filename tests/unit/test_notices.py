"""warnWebhook notices (issue 28, item 3): the policy's URL, the notice, and the bounded backlog.

The notices against a real receiver, one that fails, one that is down and one that hangs, are in
tests/apiserver/test_controller_warnings.py (with a real controller and API server).
"""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta

import pytest

from controller.cluster.notices import NOTICES_BACKLOG, Notices, host_of, warn_notice
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.objects import namespace_policy
from controller.rules.policy import Policy

DEFAULT = Policy(timedelta(days=7), timedelta(days=14))


def _policy(spec: dict[str, object]) -> tuple[Policy, list[str]]:
    return namespace_policy({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}, DEFAULT)


def test_a_policy_takes_an_http_or_https_webhook_and_refuses_any_other_without_naming_it() -> None:
    for url in ("https://hooks.example.com/x?token=1", "http://10.0.0.1:8080/"):
        policy, problems = _policy({c.WARN_WEBHOOK: {"url": url}})
        assert policy.warn_webhook == url and problems == []
    assert _policy({}) == (DEFAULT, [])
    for given in ({"url": "file:///etc/passwd?token=1"}, {"url": "https:///nohost"}, {"url": "http://[::1"}, "x", {}):
        policy, problems = _policy({c.WARN_WEBHOOK: given})
        assert policy.warn_webhook is None and len(problems) == 1
        assert "token" not in problems[0] and f"spec.{c.WARN_WEBHOOK}.url" in problems[0]


def test_logs_name_the_receivers_host_and_port_only() -> None:
    assert host_of("https://user:pw@hooks.example.com:8443/a/b?token=s3cret#f") == "hooks.example.com:8443"
    assert host_of("http://hooks.example.com/path") == "hooks.example.com"


def test_the_notice_says_which_sandbox_when_and_why() -> None:
    origin = {"pod": "p", "outcome": "Failed", "labels": {"job-name": "nightly"}}
    obj = {
        "metadata": {"name": "s", "namespace": "ns", "uid": "u-1"},
        "spec": {"nodeName": "n", "createdAt": "2026-06-01T00:00:00Z", "origin": origin},
    }
    soon = {"type": c.Condition.EXPIRING_SOON, "status": "True", "message": "expires at ..."}
    status = {"deadline": "2026-06-08T00:00:00Z", "deadlineSource": "window", "conditions": [soon]}
    assert warn_notice(obj, status) == {
        "kind": "ExpiringSoon",
        "apiVersion": c.API_VERSION,
        "namespace": "ns",
        "name": "s",
        "uid": "u-1",
        "node": "n",
        "deadline": "2026-06-08T00:00:00Z",
        "deadlineSource": "window",
        "message": "expires at ...",
        "origin": origin,
    }


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_the_backlog_is_bounded_and_what_is_dropped_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    # A wave of warnings to a receiver that is down: at most NOTICES_BACKLOG wait; past it a notice is dropped,
    # counted, and logged once per run of drops (by host, without the query).
    metrics = ControllerMetrics()
    notices = Notices(metrics, timeout=1.0, backoff=60.0)
    url = f"http://127.0.0.1:{_closed_port()}/hook?token=s3cret"
    notice = {"namespace": "ns", "name": "s"}

    async def wave() -> None:
        for _ in range(NOTICES_BACKLOG + 25):
            notices.send(url, notice)
        assert len(notices.backlog) == NOTICES_BACKLOG
        await asyncio.sleep(0.5)  # the first attempts fail (refused) and wait out their 60 s backoff
        for task in list(notices.backlog):
            task.cancel()
        await asyncio.gather(*notices.backlog, return_exceptions=True)

    asyncio.run(wave())
    dropped = metrics.registry.get_sample_value(c.M_WARN_NOTICES, {"result": c.NoticeResult.DROPPED})
    retried = metrics.registry.get_sample_value(c.M_WARN_NOTICES, {"result": c.NoticeResult.RETRIED}) or 0
    assert dropped == 25 and retried > 0
    said = [r.getMessage() for r in caplog.records if "warn_notice_dropped" in r.getMessage()]
    assert len(said) == 1 and "s3cret" not in caplog.text and "host=127.0.0.1:" in said[0]
