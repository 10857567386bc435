"""Logs as a person and a log pipeline read them: logfmt text by default, JSON lines on request, the same
event, reason code and fields either way, secrets redacted in both; the real controller in JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from controller import __version__
from controller.api.kube import Kube
from controller.rules import contracts as c
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import Controller, sandbox, wait_for

REPO = Path(__file__).resolve().parents[2]

# One decision with every kind of value: a reason code (an enum), a number, a path with a space, a quote,
# a secret-looking key, and a None that both formats drop; then an exception with its traceback.
SCRIPT = """
import logging, pathlib
from controller.observe import logs
from controller.rules.contracts import Reason
logs.setup()
log = logging.getLogger("sandkeep.test")
logs.say(log, "delete_failed", level=logging.WARNING, reason=Reason.DELETE_FAILED, files=3,
         path=pathlib.Path("/var/lib/sandkeep/a b"), note='said "no"', bearer_token="s3cr3t", gone=None)
try:
    raise OSError("EBUSY")
except OSError:
    log.exception("cannot delete")
"""


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=60, env={**_env(), **(env or {})}
    )


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SANDKEEP_LOG_FORMAT", "SANDKEEP_LOG_LEVEL")}


def _logfmt(line: str) -> dict[str, str]:
    """The key=value pairs of one logfmt line (quoted values unescaped)."""
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line)
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def test_json_and_text_lines_carry_the_same_event_reason_and_fields() -> None:
    text = _run("-c", SCRIPT, env={"SANDKEEP_LOG_FORMAT": "text"})
    as_json = _run("-c", SCRIPT, env={"SANDKEEP_LOG_FORMAT": "json"})
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr

    decision_text = next(line for line in text.stderr.splitlines() if " delete_failed " in line)
    lines = [json.loads(line) for line in as_json.stderr.splitlines()]  # every line is one JSON object
    decision, failure = lines

    assert decision["event"] == "delete_failed" and decision["level"] == "warning"
    assert decision["logger"] == "sandkeep.test" and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", decision["time"])
    fields = {k: v for k, v in decision.items() if k not in ("time", "level", "logger", "event")}
    expected = {"reason": "DeleteFailed", "files": 3, "path": "/var/lib/sandkeep/a b", "note": 'said "no"'}
    assert fields == expected | {"bearer_token": "<redacted>"}
    assert _logfmt(decision_text) == {k: str(v) for k, v in fields.items()}
    assert "s3cr3t" not in text.stderr and "s3cr3t" not in as_json.stderr

    assert failure["message"] == "cannot delete" and failure["level"] == "error"
    assert "OSError: EBUSY" in failure["exception"] and "Traceback" in failure["exception"]


def test_an_unknown_log_format_is_refused_by_flag_and_by_environment() -> None:
    flag = _run("-m", "controller.cli.sandkeep", "--log-format", "yaml", "doctor")
    assert flag.returncode == 2 and "invalid choice: 'yaml'" in flag.stderr
    env = _run("-m", "controller.cli.sandkeep", "doctor", env={"SANDKEEP_LOG_FORMAT": "yaml"})
    assert env.returncode == 2 and "'yaml' is not one of text, json" in env.stderr


def test_the_real_controller_logs_json_with_reason_codes_and_serves_process_metrics(
    cluster: LocalCluster, kube: Kube, namespace: str, tmp_path: Path
) -> None:
    ctl = Controller(
        cluster, namespace, tmp_path / "controller.log", "--retention=1h", env={"SANDKEEP_LOG_FORMAT": "json"}
    )
    try:
        ctl.wait_leader()
        kube.create_sandbox(namespace, sandbox("old", created=-timedelta(hours=2)))

        def decided() -> dict[str, Any] | None:
            lines = [json.loads(line) for line in ctl.log().splitlines() if line.strip()]
            return next((line for line in lines if line.get("event") == "delete_requested"), None)

        line = wait_for("a delete_requested JSON line", decided)
        assert line["reason"] == c.Reason.WINDOW and line["object"] == f"{namespace}/old"
        started = next(json.loads(x) for x in ctl.log().splitlines() if '"controller_started"' in x)
        with urllib.request.urlopen(started["metrics"], timeout=5) as response:
            exposed = response.read().decode()
        assert re.search(r"^process_resident_memory_bytes \d", exposed, re.M)
        assert f'sandkeep_build_info{{python="{sys.version.split()[0]}",version="{__version__}"}} 1.0' in exposed
    finally:
        ctl.stop()
