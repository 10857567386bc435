"""What every `kubectl sandkeep` command shares: the cluster and namespace as kubectl's flags name them
(`Target`), the one-line refusal (`Refused`), progress on stderr (`say`), and the signals that still end a
session (Ctrl-C, a closed terminal, a kill).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from controller.api import kube
from controller.api.kube import Kube
from controller.rules import contracts as c
from controller.rules.objects import Obj

RESOURCE = f"{c.SANDBOX_SINGULAR}.{c.GROUP}"  # how kubectl names the kind in its messages
SESSION_RESOURCE = f"{c.SESSION_SINGULAR}.{c.GROUP}"


class Refused(Exception):
    """What the plugin will not do, in the one line a person reads after `error: `."""


# --- the cluster, as kubectl's flags name it --------------------------------------------------------------
@dataclass
class Target:
    """The cluster and namespace of one invocation, and the kubectl flags that name the same ones."""

    client: Kube
    namespace: str
    kubectl_flags: list[str]

    def kubectl(self, *args: str) -> list[str]:
        return ["kubectl", *self.kubectl_flags, *args]


def connect(args: argparse.Namespace) -> Target:
    kubeconfig, context = args.kubeconfig, args.context
    try:
        client = Kube(kube.load_config(kubeconfig, context), component="kubectl-sandkeep")
        namespace = args.namespace or kube.config_namespace(kubeconfig, context)
    except Exception as err:  # no kubeconfig, an unknown context: the client's own words
        raise Refused(f"cannot load the cluster's configuration: {err}; check --kubeconfig and --context") from err
    flags = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
    flags += [f"--context={context}"] if context else []
    return Target(client, namespace, flags)


def get_sandbox(target: Target, name: str) -> Obj:
    obj = target.client.get_sandbox(target.namespace, name)
    if obj is None:
        ns = target.namespace
        raise Refused(f"{c.SANDBOX_SINGULAR} {name} not found in namespace {ns}; kubectl sandkeep ls -n {ns}")
    return obj


# --- signals: Ctrl-C, a closed terminal or a kill still end the session ------------------------------------
class Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: FrameType | None) -> NoReturn:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """The session's DELETE is not cut short by a second Ctrl-C."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    mask = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
