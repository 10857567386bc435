"""`kubectl_complete-sandkeep`: what kubectl's plugin completion gets for a command line (no cluster here;
tests/apiserver/test_krew.py completes sandbox names through the real kubectl and API server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controller.cli import kubectl_complete as kc
from controller.cli.kubectl_plugin import VERBS, parser

REPO = Path(__file__).resolve().parents[2]


def want(*words: str) -> tuple[kc.Wanted, dict[str, str]]:
    return kc.wanted(parser(), words)


def test_an_empty_word_completes_every_command_and_a_prefix_narrows_them():
    assert want("")[0].candidates == sorted(VERBS)
    assert want("p")[0].candidates == ["pin"]
    assert want("un")[0].candidates == ["unpin"]


def test_flags_are_the_commands_own_and_exclude_help():
    flags = want("ls", "--")[0].candidates
    assert "--all-namespaces" in flags and "--node" in flags and "--for" not in flags and "--help" not in flags
    assert want("pin", "x", "--f")[0].candidates == ["--for"]


def test_a_flags_choices_complete_its_value():
    assert want("ls", "-o", "")[0].candidates == ["json", "yaml", "wide"]
    assert want("doctor", "--output", "")[0].candidates == ["json"]
    kubeconfig = want("--kubeconfig", "")[0]
    assert (kubeconfig.candidates, kubeconfig.directive) == ([], 0)  # the shell's file completion


@pytest.mark.parametrize("verb", kc.NAMED)
def test_the_name_of_pin_unpin_and_open_is_a_sandbox_of_the_namespace_the_words_name(verb):
    w, given = want("--kubeconfig=/k", verb, "-n", "team", "--context", "c1", "")
    assert w.sandboxes and w.suffix == "" and w.directive == kc.NO_FILE
    assert given == {"kubeconfig": "/k", "namespace": "team", "context": "c1"}
    assert not want(verb, "sb-1", "")[0].sandboxes  # the one name is given


def test_cp_completes_NAME_colon_without_a_space_then_a_directory():
    w = want("cp", "sb")[0]
    assert (w.sandboxes, w.suffix, w.directive) == (True, ":", kc.NO_FILE | kc.NO_SPACE)
    assert not want("cp", "sb-1:")[0].sandboxes
    assert want("cp", "sb-1:/out", "")[0].directive == kc.DIRS


def test_the_executable_prints_the_candidates_then_the_directive(tmp_path):
    link = tmp_path / kc.EXECUTABLE
    link.symlink_to(Path(sys.executable).parent / "kubectl-sandkeep")
    out = subprocess.run([str(link), "pin", "--u"], capture_output=True, text=True, check=True).stdout
    assert out == "--until\n:4\n"
    # no cluster: no names, still the directive, and nothing on stdout besides
    out = subprocess.run(
        [str(link), f"--kubeconfig={tmp_path / 'missing'}", "unpin", ""], capture_output=True, text=True, check=True
    ).stdout
    assert out == ":4\n"
