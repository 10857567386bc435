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

Here: the command line, `ls` (and its table), `pin`, `unpin`, `doctor`. `open` and `cp`, which go through a
session, are `kubectl_open.py`'s; what every command shares (the cluster, `Refused`, signals) `kubectl_target.py`'s.
Called as `kubectl_complete-sandkeep` (a link to this program), it completes a command line for the shell
instead (`kubectl_complete.py`). `hack/plugin_zipapp.py` builds it as one file for krew.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NoReturn

import yaml

from controller import __version__
from controller.api.kube import KubeError
from controller.cli import doctor, kubectl_complete
from controller.cli.kubectl_open import DEFAULT_LIFETIME, cmd_cp, cmd_open
from controller.cli.kubectl_target import RESOURCE, Interrupted, Refused, Target, connect, get_sandbox, signals_raise
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
from controller.rules.sizes import human_size


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
    op.add_argument(
        "--as-job",
        action="store_true",
        help="as the job was: its recorded image and working directory, the workspace at its mount path",
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
    if Path(sys.argv[0]).name.startswith(kubectl_complete.EXECUTABLE):  # kubectl's completion convention
        return kubectl_complete.main(parser(), argv)
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
        with signals_raise():
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
