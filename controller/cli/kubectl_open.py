"""`kubectl sandkeep open` and `cp`: a SandboxSession for the caller, checked first, waited for until its Pod
runs, exec'd into (a shell, CMD, or `tar cf -` piped into node/untar.py), and ended on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import posixpath
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from controller.api.kube import Kube, KubeError, session_path
from controller.cli.kubectl_target import SESSION_RESOURCE, Refused, Target, get_sandbox, say, signals_deferred
from controller.cluster.session_decide import job_container
from controller.node import untar
from controller.rules import contracts as c
from controller.rules.durations import Invalid, format_duration, parse_duration
from controller.rules.objects import Obj
from controller.rules.reopen import expired_by_phase, sandbox_refusal

DEFAULT_LIFETIME = "1h"
DEFAULT_COMMAND = ("sh", "-c", f'cd {c.SESSION_MOUNT} && exec "${{SHELL:-sh}}"')
NAME_MAX = 63  # a session's name stays a DNS label, so whatever the controller derives from it fits
GENERATED_SUFFIX = 5  # the API server's random generateName suffix


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


def session_body(
    sandbox: str, user: str, *, read_write: bool, lifetime: str, image: str | None, as_job: bool = False
) -> Obj:
    prefix = sandbox[: NAME_MAX - GENERATED_SUFFIX - 1].rstrip("-.")
    spec: Obj = {"sandbox": sandbox, "user": user, "readWrite": read_write, "lifetime": lifetime}
    if image:
        spec["image"] = image
    if as_job:
        spec["asJob"] = True
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


def as_whom(obj: Obj, *, as_job: bool) -> str:
    """Where and as whom the session sees the workspace, said before it starts; refuses `as_job` (here, before
    anything is created) for a sandbox that records no job container, as the controller would."""
    job = job_container(obj)
    if as_job and job is None:
        raise Refused(
            f"{obj['metadata']['name']} records no container that mounted its workspace whole (only a workspace "
            "kept through sandkeep's CSI volume does), so it cannot be opened as its job was; open it without --as-job"
        )
    if as_job and job:
        where = f"at {job['mountPath']} in {job['image']}"
        if job.get("runAsUser") is not None:
            ran = job["runAsUser"]
            return f"{where}; the job ran as uid {ran}, which the session runs as if it is at least sessions.minOwnerId"
    else:
        where = f"at {c.SESSION_MOUNT}"
    owner = ((obj.get("status") or {}).get("owner") or {}).get("uid")
    if owner == 0:  # a session never runs as root (Pod Security restricted): the files' modes decide
        where += (
            "; the workspace is owned by root and the session is not root: it reads what the files' modes let "
            "other users read, and a file only root may read says Permission denied"
        )
    return where


@contextlib.contextmanager
def opened(
    target: Target,
    sandbox: str,
    *,
    read_write: bool,
    lifetime: str,
    image: str | None,
    keep: bool,
    timeout: timedelta,
    as_job: bool = False,
) -> Iterator[Session]:
    """A running session on `sandbox`: checked here first (nothing is created for a sandbox that cannot be
    opened), created for the caller, waited for, and deleted on the way out unless `keep`, also on Ctrl-C."""
    lifetime = check_lifetime(lifetime)
    obj = get_sandbox(target, sandbox)
    refuse_closed(obj)
    where = as_whom(obj, as_job=as_job)
    user = whoami(target.client)
    body = session_body(sandbox, user, read_write=read_write, lifetime=lifetime, image=image, as_job=as_job)
    created = target.client.request("POST", session_path(target.namespace), body=body)
    session = Session(target.namespace, created["metadata"]["name"])
    mode = "read-write" if read_write else "read-only"
    say(f"{SESSION_RESOURCE}/{session.name} created ({mode}, lifetime {lifetime}, for {user}; {where})")
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
    with signals_deferred():
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
        as_job=args.as_job,
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
