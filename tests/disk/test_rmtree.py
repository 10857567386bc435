"""The compiled walker (rmtree/, `sandkeep-rmtree`) beside what tests/disk/test_fsdelete*.py run with both
walkers: its own Go tests (the races that need a step between two of its own, through its hooks), its refusal
of bad arguments, and fsdelete's answer when it cannot run or answer: a failure, the tree untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.node import fsdelete
from controller.rules.contracts import Reason
from tests.bed.diskkit import REPO, listing

COMPILED = Path(sys.executable).parent / fsdelete.COMPILED


def go(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
    return subprocess.run(["go", *args], cwd=REPO / "rmtree", env=env, capture_output=True, text=True, check=False)


def test_the_compiled_walkers_own_tests_pass() -> None:
    vet = go("vet", "./...")
    assert vet.returncode == 0, vet.stdout + vet.stderr
    run = go("test", "-count=1", "-v", "./...")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("--- PASS") == 6, run.stdout  # every test ran: none skipped, none lost


BAD = [[], ["3", "t"], ["3", "../t", "4"], ["3", "t", "0"], ["3", "t", "257"], ["x", "t", "4"], ["3", "..", "4"]]


@pytest.mark.parametrize("args", BAD)
def test_bad_arguments_are_refused_before_anything_is_touched(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "t").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.run([str(COMPILED), *args], pass_fds=(fd,), capture_output=True, text=True, check=False)
    finally:
        os.close(fd)
    assert proc.returncode == 2 and proc.stdout == "" and "sandkeep-rmtree" in proc.stderr, proc
    assert listing(tmp_path) == ["t"]


@pytest.mark.parametrize("binary", ["/bin/false", "/nonexistent/sandkeep-rmtree", "/bin/echo"])
def test_a_walker_that_cannot_answer_fails_the_delete_and_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, binary: str
) -> None:
    (tmp_path / "t" / "d").mkdir(parents=True)
    (tmp_path / "t" / "d" / "f").write_text("x")
    monkeypatch.setenv("SANDKEEP_RMTREE", binary)
    result = fsdelete.delete_tree(tmp_path, "t")
    assert not result.ok and result.reason is Reason.DELETE_FAILED and result.path == str(tmp_path / "t"), result
    assert listing(tmp_path / "t" / "d") == ["f"]


def test_the_walker_beside_the_interpreter_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDKEEP_RMTREE", raising=False)
    assert fsdelete.compiled_walker() == str(COMPILED), "`make venv` builds it beside the interpreter"
    monkeypatch.setenv("SANDKEEP_RMTREE", "")
    assert fsdelete.compiled_walker() is None


def test_the_walkers_of_one_process_share_its_goroutines() -> None:
    slots = fsdelete._Slots(32)
    with slots.take(32) as first, slots.take(8) as second:
        assert (first, second) == (32, 1)  # none left: the second still gets its own walk
    with slots.take(8) as first, slots.take(32) as second, slots.take(32) as third:
        assert (first, second, third) == (8, 24, 1)
    assert slots.used == 0
