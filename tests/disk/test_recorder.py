"""The command recorder when its record cannot be written: said once, written again on the next walk.

The reference logs a failed record write once and retries it on the next walk; a recorder that logged on
every 100 ms walk would flood the log, and one that did not retry would leave the orphans unrecorded.
"""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.cli import exec as sandkeep_exec
from controller.node.orphan_records import Mark, Recorder, boot_id, open_commands_dir
from controller.node.store import Root
from tests.bed.diskkit import make_immutable

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: immutable


def start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2 :].split()[19])


@pytest.mark.root
def test_a_record_that_cannot_be_written_is_said_once_and_written_on_the_next_walk(
    tmp_path: Path, immutable: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "sandkeep")
    src = tmp_path / "job"
    src.mkdir()
    root = Root(tmp_path / "root")
    root.retain(src, "ns", "box", job_id="j1", created_at=datetime.now(UTC), retention=timedelta(hours=1))
    box = root.sandbox_path("ns", "box")
    (box / ".commands").mkdir(mode=0o700, exist_ok=True)
    leader = subprocess.Popen(["sleep", "30"])  # the recorded command, alive throughout
    waited = subprocess.Popen(["sleep", "0.6"])  # what the walks run beside: about six of them
    try:
        with open_commands_dir(box, create=True) as cfd:
            assert cfd is not None
            recorder = Recorder(cfd, Mark(leader.pid, start_ticks(leader.pid)), boot_id() or "")
            make_immutable(immutable, box / ".commands")  # no file can be created in it, by root either
            assert sandkeep_exec._wait_recording(waited, recorder) == 0
            assert [m for m in caplog.messages if m.startswith("record_failed")] != []
            assert len([m for m in caplog.messages if m.startswith("record_failed")]) == 1
            assert recorder.dirty and list((box / ".commands").glob("*.json")) == []
            subprocess.run(["chattr", "-i", str(box / ".commands")], check=True)
            assert recorder.walk()  # nothing new was seen; the owed record is written anyway
            assert not recorder.dirty
            (record,) = [json.loads(p.read_text()) for p in (box / ".commands").glob("*.json")]
            assert record["leader"]["pid"] == leader.pid
    finally:
        for p in (leader, waited):
            if p.poll() is None:
                p.kill()
            p.wait()
