"""Shell completion for `kubectl sandkeep`, by kubectl's plugin convention (kubectl 1.26 and later).

When a shell completes `kubectl sandkeep pin sb<TAB>`, kubectl runs `kubectl_complete-sandkeep pin sb` (the
words after the plugin's name, the last one the word being completed, `""` for a new one) from PATH and reads
one candidate a line, then `:N`, a Cobra ShellCompDirective. `kubectl_complete-sandkeep` is a link to the
plugin itself: `kubectl_plugin.main` answers here when it is called by that name. Completes the commands,
each command's flags, the choices of `-o`, and sandbox names (pin, unpin, open; cp's `NAME:`) from the
cluster the words name (`--kubeconfig`, `--context`, `-n`). A cluster that does not answer completes
nothing, and prints nothing to stdout but the directive.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from controller.cli.kubectl_target import connect

EXECUTABLE = "kubectl_complete-sandkeep"  # kubectl looks it up on PATH: kubectl_complete-<plugin>
# Cobra's ShellCompDirective bits.
NO_SPACE = 2
NO_FILE = 4
DIRS = 16
CONTEXT_FLAGS = {"--kubeconfig": "kubeconfig", "--context": "context", "-n": "namespace", "--namespace": "namespace"}
NAMED = ("pin", "unpin", "open")  # commands whose one positional is a sandbox's name


@dataclass
class Wanted:
    """What to complete: fixed candidates, or (sandboxes) the sandboxes' names from the cluster."""

    candidates: list[str] = field(default_factory=list)
    directive: int = NO_FILE
    sandboxes: bool = False
    suffix: str = ""  # appended to every looked-up name (cp's NAME:)


def _verbs(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings if o not in ("-h", "--help", "--version")}


def wanted(top: argparse.ArgumentParser, words: Sequence[str]) -> tuple[Wanted, dict[str, str]]:
    """The pure core: what completes the last of WORDS, and the cluster flags the words give."""
    *before, current = list(words) or [""]
    verbs = _verbs(top)
    verb: str | None = None
    given: dict[str, str] = {}
    positionals = 0
    flags = _flags(top)
    i = 0
    while i < len(before):
        word = before[i]
        name, eq, value = word.partition("=")
        if word.startswith("-") and name in flags:
            takes = flags[name].nargs != 0
            if takes and not eq:
                if i + 1 == len(before):  # completing this flag's value
                    return _value_of(flags[name], name), given
                value = before[i + 1]
                i += 1
            if name in CONTEXT_FLAGS and takes:
                given[CONTEXT_FLAGS[name]] = value
        elif verb is None and word in verbs:
            verb = word
            flags = _flags(verbs[word])
        elif not word.startswith("-"):
            positionals += 1
        i += 1
    if verb is None:
        pool = sorted(flags) if current.startswith("-") else sorted(verbs)
        return Wanted([w for w in pool if w.startswith(current)]), given
    if current.startswith("-"):
        return Wanted([w for w in sorted(flags) if w.startswith(current)]), given
    if verb in NAMED and positionals == 0:
        return Wanted(sandboxes=True), given
    if verb == "cp" and positionals == 0 and ":" not in current:
        return Wanted(directive=NO_FILE | NO_SPACE, sandboxes=True, suffix=":"), given
    if verb == "cp" and positionals == 1:
        return Wanted(directive=DIRS), given
    return Wanted(), given


def _value_of(action: argparse.Action, flag: str) -> Wanted:
    if action.choices:
        return Wanted([str(c) for c in action.choices])
    if flag == "--kubeconfig":
        return Wanted(directive=0)  # the shell's own file completion
    return Wanted()


def sandbox_names(given: dict[str, str]) -> list[str]:
    """The sandboxes' names in the namespace (and cluster) the words name; none when the cluster fails."""
    args = argparse.Namespace(**{k: given.get(k) for k in ("kubeconfig", "context", "namespace")})
    try:
        target = connect(args)
        try:
            return sorted(o["metadata"]["name"] for o in target.client.list_sandboxes(target.namespace))
        finally:
            target.client.close()
    except Exception:  # completion never fails the shell: no cluster, no names
        return []


def main(
    top: argparse.ArgumentParser, words: Sequence[str], lookup: Callable[[dict[str, str]], list[str]] = sandbox_names
) -> int:
    want, given = wanted(top, words)
    current = (list(words) or [""])[-1]
    found = want.candidates
    if want.sandboxes:
        found = [n + want.suffix for n in lookup(given) if (n + want.suffix).startswith(current)]
    sys.stdout.write("".join(f"{c}\n" for c in found) + f":{want.directive}\n")
    return 0
