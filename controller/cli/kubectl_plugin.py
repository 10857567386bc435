"""`kubectl sandkeep`: the everyday front end, as a kubectl plugin (the `kubectl-sandkeep` console script).

kubectl finds `kubectl-sandkeep` on PATH and passes every argument through, so this program follows kubectl's
own conventions: `--kubeconfig`, `--context`, `-n/--namespace` (default: the context's namespace, else
`default`), `-A/--all-namespaces`, `-o json|yaml|wide`, and exit 0 on success, 1 with one `error: ...` line on
stderr that says what to do next. Reads and writes go through sandkeep's own client (`controller.api.kube`);
`kubectl` itself runs only for exec, which needs its streaming, with the same --kubeconfig and --context:
the session's Pod runs in the sandbox's own namespace, so exec is the user's own `pods/exec` there.

    ls      sandboxes with node, phase, size, deadline, pin, holders
    pin     `--for 72h` or `--until T`: the pin annotations, checked here with the grammar the controller uses
    unpin   removes the pin annotations
    open    a SandboxSession: waits until its Pod runs, execs a shell or CMD in it, ends it on exit
    cp      copies a path of the workspace out through a read-only session into DEST, and nowhere else
    doctor  what needs a person (the same report as `sandkeep doctor`)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import posixpath
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import NoReturn

import yaml

from controller import __version__
from controller.api import kube
from controller.api.kube import Kube, KubeError
from controller.cli import doctor
from controller.cluster.sessions import session_path
from controller.node import untar
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.durations import (
    Invalid,
    format_duration,
    format_instant,
    instant_or_none,
    parse_duration,
    parse_instant,
)
from controller.rules.objects import Obj
from controller.rules.reopen import expired_by_phase, sandbox_refusal
from controller.rules.sizes import human_size

RESOURCE = f"{c.SANDBOX_SINGULAR}.{c.GROUP}"  # how kubectl names the kind in its messages
SESSION_RESOURCE = f"{c.SESSION_SINGULAR}.{c.GROUP}"
DEFAULT_LIFETIME = "1h"
DEFAULT_COMMAND = ("sh", "-c", f'cd {c.SESSION_MOUNT} && exec "${{SHELL:-sh}}"')
NAME_MAX = 63  # a session's name stays a DNS label, so whatever the controller derives from it fits
GENERATED_SUFFIX = 5  # the API server's random generateName suffix
# Phases a session cannot be opened on, and what to tell the person instead.
CLOSED = (c.Phase.EXPIRED, c.Phase.DELETING, c.Phase.STUCK, c.Phase.LOST)


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


# --- ls ---------------------------------------------------------------------------------------------------
def relative(when: datetime | None, now: datetime) -> str:
    """`in 3h`, `2d4h ago`: how far an instant is from now, as a person reads a deadline."""
    if when is None:
        return ""
    delta = when - now
    return f"in {format_duration(delta)}" if delta >= timedelta(0) else f"{format_duration(-delta)} ago"


def holders(status: Obj) -> str:
    """What holds a sandbox: the first holder, and how many more (kubectl's `<none>` when nothing)."""
    held = [str(h) for h in status.get("heldBy") or []]
    if not held:
        return "<none>"
    first = held[0] if len(held[0]) <= 40 else held[0][:39] + "…"
    return first if len(held) == 1 else f"{first} (+{len(held) - 1})"


def ls_row(obj: Obj, now: datetime, *, wide: bool, all_namespaces: bool) -> list[str]:
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    size_bytes = status.get("sizeBytes")
    size = human_size(size_bytes) if isinstance(size_bytes, int) else str(status.get("size") or "<unknown>")
    deadline = instant_or_none(status.get("deadline"))
    shown = f"{format_instant(deadline)} ({relative(deadline, now)})" if deadline else "<unknown>"
    if (objects.condition_of(obj, c.Condition.EXPIRING_SOON) or {}).get("status") == "True":
        shown += " ExpiringSoon"  # within its policy's warnBefore (issue 28)
    pinned = instant_or_none(status.get("pinnedUntil"))
    row = [meta["name"], spec.get("nodeName", "<none>"), status.get("phase") or "<unknown>", size, shown]
    row += [format_instant(pinned) if pinned else "<none>", holders(status)]
    if wide:
        files = status.get("fileCount")
        row += [
            str(files) if isinstance(files, int) else "<unknown>",
            str(size_bytes) if isinstance(size_bytes, int) else "<unknown>",
            str(status.get("deadlineSource") or "<unknown>"),
        ]
    return [meta["namespace"], *row] if all_namespaces else row


def ls_table(items: list[Obj], now: datetime, *, wide: bool, all_namespaces: bool) -> str:
    header = ["NAME", "NODE", "PHASE", "SIZE", "DEADLINE", "PIN", "HOLDERS"]
    header += ["FILES", "BYTES", "SOURCE"] if wide else []
    header = ["NAMESPACE", *header] if all_namespaces else header
    rows = [ls_row(o, now, wide=wide, all_namespaces=all_namespaces) for o in items]
    return table(header, rows)


def table(header: list[str], rows: list[list[str]]) -> str:
    """kubectl's table: columns left-aligned, three spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "".join(
        "   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in [header, *rows]
    )


def as_list(items: list[Obj], output: str) -> str:
    """`-o json|yaml` as kubectl prints a list: a `v1` List of the objects as the server returned them."""
    doc = {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}
    return json.dumps(doc, indent=4) + "\n" if output == "json" else yaml.safe_dump(doc, sort_keys=False)


def cmd_ls(target: Target, args: argparse.Namespace) -> int:
    namespace = None if args.all_namespaces else target.namespace
    items = sorted(target.client.list_sandboxes(namespace, node=args.node), key=objects.key_of)
    if args.output in ("json", "yaml"):
        print(as_list(items, args.output), end="")
        return 0
    if not items:
        where = "" if namespace is None else f" in {namespace} namespace"
        print(f"No resources found{where}.", file=sys.stderr)
        return 0
    wide = args.output == "wide"
    print(ls_table(items, datetime.now(UTC), wide=wide, all_namespaces=namespace is None), end="")
    return 0


# --- pin, unpin -------------------------------------------------------------------------------------------
def pin_changes(for_: str | None, until: str | None, now: datetime) -> tuple[dict[str, str | None], str]:
    """The annotation changes a pin asks for and how to say it, checked first with durations.py's grammar
    (the one the admission policy and the controller use), so bad input is refused before anything is written.

    `--for` writes pin-for (the controller settles it into pin-until and pinned-at); `--until` writes
    pin-until and drops pin-for and the old pinned-at, so the controller stamps a fresh one for the maxPin cap.
    """
    if for_ is not None:
        duration = parse_duration(for_)
        if isinstance(duration, Invalid):
            raise Refused(f"--for {duration}")
        if duration <= timedelta(0):
            raise Refused("--for 0 pins nothing; to remove a pin use kubectl sandkeep unpin")
        about = format_instant(now + duration)
        return {c.ANN_PIN_FOR: for_.strip(), c.ANN_PIN_UNTIL: None}, f"pinned for {for_.strip()} (until {about})"
    assert until is not None
    when = parse_instant(until)
    if isinstance(when, Invalid):
        raise Refused(f"--until {when}")
    if when <= now:
        raise Refused(f"--until {until.strip()} is in the past: a pin only extends a deadline; pick a later time")
    changes: dict[str, str | None] = {c.ANN_PIN_UNTIL: format_instant(when), c.ANN_PIN_FOR: None}
    return {**changes, c.ANN_PINNED_AT: None}, f"pinned until {format_instant(when)}"


def patch_pins(target: Target, name: str, changes: dict[str, str | None]) -> Obj:
    """The merge patch, guarded by the resourceVersion read (a concurrent change is read again, not overwritten)."""
    for _attempt in range(3):
        obj = get_sandbox(target, name)
        if objects.is_deleting(obj):
            raise Refused(
                f"{c.SANDBOX_SINGULAR} {name} in namespace {target.namespace} is being deleted; a deletion is "
                "final, so a pin cannot keep it (nothing was changed)"
            )
        try:
            return target.client.patch_annotations(obj, changes)
        except KubeError as err:
            if not err.conflict:
                raise
    raise Refused(f"{c.SANDBOX_SINGULAR} {name} kept changing while it was being pinned; try again")


def cmd_pin(target: Target, args: argparse.Namespace) -> int:
    if (args.for_ is None) == (args.until is None):
        raise Refused("pin needs exactly one of --for DURATION (e.g. 72h) or --until TIME (e.g. 2026-12-24T18:00:00Z)")
    changes, said = pin_changes(args.for_, args.until, datetime.now(UTC))
    patch_pins(target, args.name, changes)
    print(f"{RESOURCE}/{args.name} {said}")
    return 0


def cmd_unpin(target: Target, args: argparse.Namespace) -> int:
    obj = get_sandbox(target, args.name)
    pins = (c.ANN_PIN_FOR, c.ANN_PIN_UNTIL, c.ANN_PINNED_AT)
    if not any(k in objects.annotations_of(obj) for k in pins):
        print(f"{RESOURCE}/{args.name} not pinned")
        return 0
    target.client.patch_annotations(obj, dict.fromkeys(pins))
    print(f"{RESOURCE}/{args.name} unpinned")
    return 0


# --- doctor -----------------------------------------------------------------------------------------------
def cmd_doctor(target: Target, args: argparse.Namespace) -> int:
    stale_after = parse_duration(args.stale_after)
    if isinstance(stale_after, Invalid):
        raise Refused(f"--stale-after {stale_after}")
    sandbox_namespace = None if args.all_namespaces or not args.namespace else target.namespace
    try:
        report = doctor.examine(
            target.client, stale_after, install_namespace=args.install_namespace, sandbox_namespace=sandbox_namespace
        )
    except doctor.DoctorError as err:
        raise Refused(str(err)) from err
    print(doctor.as_json(report) if args.output == "json" else doctor.render(report), end="")
    return 1 if report.needs_a_person else 0


# --- sessions ---------------------------------------------------------------------------------------------
def whoami(client: Kube) -> str:
    """The caller's own user name, from the SelfSubjectReview API (what `kubectl auth whoami` asks)."""
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    answer = client.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", body=review)
    user = ((answer or {}).get("status") or {}).get("userInfo", {}).get("username")
    if not user:
        raise Refused("the API server did not say who you are (SelfSubjectReview); check your credentials")
    return str(user)


def refuse_closed(obj: Obj) -> None:
    """Refuse here, before anything is created, what the controller would refuse (the one place that says
    so: `rules.reopen.sandbox_refusal`). The plugin reads no policy: expired is the controller's phase."""
    meta = obj["metadata"]
    refusal = sandbox_refusal(obj, expired_by_phase(obj), meta["namespace"], meta["name"])
    if refusal is not None:
        raise Refused(refusal[1])


def session_body(sandbox: str, user: str, *, read_write: bool, lifetime: str, image: str | None) -> Obj:
    prefix = sandbox[: NAME_MAX - GENERATED_SUFFIX - 1].rstrip("-.")
    spec: Obj = {"sandbox": sandbox, "user": user, "readWrite": read_write, "lifetime": lifetime}
    if image:
        spec["image"] = image
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.SESSION_KIND,
        "metadata": {"generateName": f"{prefix}-"},
        "spec": spec,
    }


def check_lifetime(text: str) -> str:
    lifetime = parse_duration(text)
    if isinstance(lifetime, Invalid):
        raise Refused(f"--lifetime {lifetime}")
    if lifetime <= timedelta(0):
        raise Refused("--lifetime 0 would end the session before it starts; use e.g. 30m or 1h")
    return text.strip()


@dataclass
class Session:
    namespace: str
    name: str
    pod_namespace: str = ""
    pod_name: str = ""


def wait_running(
    client: Kube,
    session: Session,
    timeout: timedelta,
    say: Callable[[str], None],
    interval: float = 0.5,
) -> Session:
    """Until the session's status says Running (and names its Pod); Refused or Ended is the error it says.

    Progress goes to `say` each time the reason or message changes, as `kubectl rollout status` prints.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last: tuple[str, str] | None = None
    while True:
        try:
            obj = client.request("GET", session_path(session.namespace, session.name))
        except KubeError as err:
            if err.not_found:
                raise Refused(f"{c.SESSION_SINGULAR} {session.name} was deleted while waiting for it") from err
            raise
        status = obj.get("status") or {}
        phase, reason, message = status.get("phase"), status.get("reason") or "", status.get("message") or ""
        if phase == c.SessionPhase.RUNNING and status.get("podName") and status.get("podNamespace"):
            session.pod_name, session.pod_namespace = status["podName"], status["podNamespace"]
            return session
        if phase in (c.SessionPhase.REFUSED, c.SessionPhase.ENDED):
            why = f"{reason}: {message}" if reason else message or "no reason given"
            raise Refused(f"{c.SESSION_SINGULAR} {session.name} {str(phase).lower()}: {why}")
        if (reason, message) != last and (reason or message):
            say(f"waiting for session {session.name}: {reason}: {message}" if reason else message)
        last = (reason, message)
        if time.monotonic() >= deadline:
            raise Refused(
                f"{c.SESSION_SINGULAR} {session.name} not running after {format_duration(timeout)} "
                f"(last: {reason or phase or 'no status'}); is the sandkeep controller running? "
                f"kubectl describe {c.SESSION_SHORT} {session.name} -n {session.namespace}"
            )
        time.sleep(interval)


def exec_argv(target: Target, session: Session, command: Sequence[str], *, stdin: bool, tty: bool) -> list[str]:
    """`kubectl exec` into the session's container: -i to pass stdin on, -t only when it is a terminal."""
    flags = ["-it"] if stdin and tty else ["-i"] if stdin else []
    where = ["-n", session.pod_namespace, session.pod_name, "-c", c.SESSION_CONTAINER]
    return target.kubectl("exec", *flags, *where, "--", *command)


def exec_in_session(target: Target, session: Session, command: Sequence[str]) -> int:
    """The one step that needs a real Pod: kubectl exec, attached to this terminal; its exit code is ours."""
    argv = exec_argv(target, session, command, stdin=True, tty=sys.stdin.isatty())
    return subprocess.run(argv, check=False).returncode


@contextlib.contextmanager
def opened(
    target: Target, sandbox: str, *, read_write: bool, lifetime: str, image: str | None, keep: bool, timeout: timedelta
) -> Iterator[Session]:
    """A running session on `sandbox`: checked here first (nothing is created for a sandbox that cannot be
    opened), created for the caller, waited for, and deleted on the way out unless `keep`, also on Ctrl-C."""
    lifetime = check_lifetime(lifetime)
    refuse_closed(get_sandbox(target, sandbox))
    user = whoami(target.client)
    body = session_body(sandbox, user, read_write=read_write, lifetime=lifetime, image=image)
    created = target.client.request("POST", session_path(target.namespace), body=body)
    session = Session(target.namespace, created["metadata"]["name"])
    mode = "read-write" if read_write else "read-only"
    say(f"{SESSION_RESOURCE}/{session.name} created ({mode}, lifetime {lifetime}, for {user})")
    try:
        yield wait_running(target.client, session, timeout, say)
    finally:
        if keep:
            say(
                f"{SESSION_RESOURCE}/{session.name} kept; end it with kubectl delete {c.SESSION_SHORT} "
                f"{session.name} -n {session.namespace}"
            )
        else:
            end_session(target.client, session)


def end_session(client: Kube, session: Session) -> None:
    with _signals_deferred():
        try:
            client.request("DELETE", session_path(session.namespace, session.name))
        except KubeError as err:
            if not err.not_found:
                say(
                    f"warning: {c.SESSION_SINGULAR} {session.name} not deleted ({err.message}); "
                    f"kubectl delete {c.SESSION_SHORT} {session.name} -n {session.namespace}"
                )
                return
    say(f"{SESSION_RESOURCE}/{session.name} deleted")


def cmd_open(target: Target, args: argparse.Namespace) -> int:
    command = list(args.command or DEFAULT_COMMAND)
    with opened(
        target,
        args.name,
        read_write=args.rw,
        lifetime=args.lifetime,
        image=args.image,
        keep=args.keep,
        timeout=_timeout(args),
    ) as session:
        return exec_in_session(target, session, command)


# --- cp ---------------------------------------------------------------------------------------------------
def workspace_path(text: str) -> tuple[str, str]:
    """(directory, entry) of a path inside the workspace, for `tar -C /sandbox/<directory> <entry>`;
    an absolute path or one that climbs out with `..` is refused."""
    if not text or text.startswith("/"):
        raise Refused(
            f"{text!r} is not a path inside the workspace; give it relative to {c.SESSION_MOUNT}, e.g. logs/build.log"
        )
    norm = posixpath.normpath(text)
    if norm == ".." or norm.startswith("../"):
        raise Refused(f"{text!r} leaves the workspace; give a path inside it, e.g. logs/build.log")
    if norm == ".":
        return ".", "."
    directory, entry = posixpath.split(norm)
    return directory or ".", entry


def copy_from_session(target: Target, session: Session, path: str, dest: Path, *, merge: bool) -> int:
    """`tar cf -` in the session's container piped into `untar`, which writes below DEST and nowhere else;
    each member it refuses is one warning, and any refusal makes the exit non-zero."""
    directory, entry = workspace_path(path)
    source = c.SESSION_MOUNT if directory == "." else posixpath.join(c.SESSION_MOUNT, directory)
    argv = exec_argv(target, session, ["tar", "cf", "-", "-C", source, "--", entry], stdin=False, tty=False)
    stopped = ""
    dest_fd = untar.open_dest(dest, merge=merge)  # its UntarError is an `error:` line, as Refused is
    try:
        with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            try:
                done = untar.extract(proc.stdout, dest_fd, warn=_refused_member)
            except untar.UntarError as err:
                stopped = str(err)
            finally:
                proc.stdout.close()
                code = proc.wait()
    except OSError as err:  # kubectl itself would not start
        raise Refused(f"cannot run kubectl exec: {err.strerror or err}") from err
    finally:
        os.close(dest_fd)
    if stopped:  # first: tar then dies of the closed pipe, which says less
        exited = f" (tar exited {code})" if code else ""
        raise Refused(f"copying {path} to {dest} stopped: {stopped}{exited}")
    if code != 0:
        raise Refused(f"copying {path} from {c.SESSION_SINGULAR} {session.name} failed (tar exited {code})")
    if done.refused:
        raise Refused(
            f"refused {_entries(done.refused)} of {path} (see the warnings above); copied {done.written} to {dest}"
        )
    say(f"copied {_entries(done.written)} of {path} to {dest}")
    return 0


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _refused_member(name: str, why: str) -> None:
    say(f"warning: refused to unpack {name!r}: {why}")


def cmd_cp(target: Target, args: argparse.Namespace) -> int:
    name, sep, path = args.source.partition(":")
    if not sep or not name or not path:
        raise Refused(f"{args.source!r}: give the source as NAME:PATH, e.g. run-42:logs/build.log")
    workspace_path(path)  # refused before a session is opened, and so is DEST
    dest = Path(args.dest)
    untar.check_dest(dest, merge=args.merge)
    with opened(
        target, name, read_write=False, lifetime=args.lifetime, image=None, keep=False, timeout=_timeout(args)
    ) as session:
        return copy_from_session(target, session, path, dest, merge=args.merge)


def _timeout(args: argparse.Namespace) -> timedelta:
    timeout = parse_duration(args.timeout)
    if isinstance(timeout, Invalid):
        raise Refused(f"--timeout {timeout}")
    return timeout


# --- signals: Ctrl-C, a closed terminal or a kill still end the session ------------------------------------
class Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: FrameType | None) -> NoReturn:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
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


# --- the command line -------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Bad flags exit 1 with one `error:` line, as kubectl's do (argparse's own exit code is 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(1, f"error: {message}; see {self.prog} --help\n")


def _common() -> _Parser:
    """kubectl's global flags, accepted before and after the subcommand (SUPPRESS: a subcommand's unset copy
    does not overwrite one given before it)."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--kubeconfig", default=argparse.SUPPRESS, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    common.add_argument("--context", default=argparse.SUPPRESS, help="the kubeconfig context to use")
    common.add_argument(
        "-n", "--namespace", default=argparse.SUPPRESS, help="namespace (default: the context's, else default)"
    )
    return common


def parser() -> argparse.ArgumentParser:
    common = _common()
    top = _Parser(prog="kubectl sandkeep", description=(__doc__ or "").splitlines()[0], parents=[common])
    top.add_argument("--version", action="version", version=f"kubectl-sandkeep {__version__}")
    sub = top.add_subparsers(dest="verb", required=True, metavar="COMMAND", parser_class=_Parser)

    ls = sub.add_parser("ls", parents=[common], help="list sandboxes: node, phase, size, deadline, pin, holders")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    ls.add_argument("-o", "--output", choices=("json", "yaml", "wide"), help="json, yaml or wide (default: a table)")
    ls.add_argument("--node", help="only sandboxes on this node (server-side, spec.nodeName)")

    pin = sub.add_parser("pin", parents=[common], help="keep a sandbox longer: --for 72h or --until TIME")
    pin.add_argument("name")
    pin.add_argument("--for", dest="for_", metavar="DURATION", help="e.g. 90m, 72h, 3d, 2w, 1h30m")
    pin.add_argument("--until", metavar="TIME", help="RFC 3339 with a zone, e.g. 2026-12-24T18:00:00Z")

    unpin = sub.add_parser("unpin", parents=[common], help="remove a sandbox's pin")
    unpin.add_argument("name")

    op = sub.add_parser("open", parents=[common], help="open a shell (or CMD) in a sandbox's workspace")
    op.add_argument("name")
    op.add_argument("--rw", action="store_true", help="mount the workspace writable (default read-only)")
    op.add_argument(
        "--image",
        help="the session container's image: the chart's sessions.image (default) or one of sessions.allowedImages",
    )
    op.add_argument(
        "--lifetime", default=DEFAULT_LIFETIME, help=f"how long the session may run (default {DEFAULT_LIFETIME})"
    )
    op.add_argument("--keep", action="store_true", help="do not end the session on exit (it ends after its lifetime)")
    op.add_argument("--timeout", default="5m", help="how long to wait for the session to run (default 5m)")

    cp = sub.add_parser("cp", parents=[common], help="copy NAME:PATH (inside the workspace) into the directory DEST")
    cp.add_argument("source", metavar="NAME:PATH")
    cp.add_argument("dest", metavar="DEST")
    cp.add_argument(
        "--merge",
        action="store_true",
        help="copy into a DEST that is not empty (an existing name is never overwritten)",
    )
    cp.add_argument("--lifetime", default="15m", help="the read-only session's lifetime (default 15m)")
    cp.add_argument("--timeout", default="5m", help="how long to wait for the session to run (default 5m)")

    dr = sub.add_parser("doctor", parents=[common], help="what needs a person (the same report as sandkeep doctor)")
    dr.add_argument("-A", "--all-namespaces", action="store_true", help="sandboxes of every namespace (the default)")
    dr.add_argument("-o", "--output", choices=("json",), help="json for scripts (default: the report)")
    dr.add_argument("--install-namespace", help="the namespace sandkeep runs in (default: found from its Leases)")
    dr.add_argument("--stale-after", default="2m", help="a heartbeat older than this is stale (default 2m)")
    return top


VERBS: dict[str, Callable[[Target, argparse.Namespace], int]] = {
    "ls": cmd_ls,
    "pin": cmd_pin,
    "unpin": cmd_unpin,
    "open": cmd_open,
    "cp": cmd_cp,
    "doctor": cmd_doctor,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:  # `open NAME -- CMD...`: everything after `--` is the command, flags and all
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args = parser().parse_args(argv)
    for flag in ("kubeconfig", "context", "namespace"):
        setattr(args, flag, getattr(args, flag, None))
    args.command = command
    if command and args.verb != "open":
        print(f"error: only open takes a command after --; see kubectl sandkeep {args.verb} --help", file=sys.stderr)
        return 1
    try:
        with _signals_raise():
            return VERBS[args.verb](connect(args), args)
    except (Refused, untar.UntarError) as err:
        print(f"error: {err}", file=sys.stderr)
    except KubeError as err:
        print(f"error: {err.message or err} (HTTP {err.status})", file=sys.stderr)
    except Interrupted as err:
        print(f"error: interrupted ({err})", file=sys.stderr)
        return 128 + err.signum
    return 1


if __name__ == "__main__":
    sys.exit(main())
