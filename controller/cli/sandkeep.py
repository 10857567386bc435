"""`sandkeep`: one console script, one subcommand per concept, each implemented in the module named here.

A command's module is imported only when that command runs, so `sandkeep ls` does not pay for kopf.
Each module provides `add_arguments(command, parser)` and `run(command, args) -> exit code`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from controller import __version__
from controller.observe import logs
from controller.rules import flags

log = logging.getLogger("sandkeep")

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "retain": ("controller.cli.standalone", "retain a finished job's directory under a root (rename, never copy)"),
    "pin": ("controller.cli.standalone", "pin a retained sandbox in a standalone root"),
    "ls": ("controller.cli.standalone", "list the sandboxes of a root with their deadlines"),
    "sweep": ("controller.cli.standalone", "the standalone sweep: delete expired sandboxes of one root safely"),
    "controller": ("controller.cluster.main", "run the cluster controller (kopf): decide keep or delete"),
    "agent": ("controller.agent", "run the node agent: observe the node's root, delete behind the finalizer"),
    "csi-node": ("controller.cli.csi_node", "serve the CSI node plugin: capture workspaces as volumes (container)"),
    "csi-registrar": (
        "controller.cli.csi_registrar",
        "register the CSI node plugin with the kubelet (sidecar)",
    ),
    "exec": ("controller.cli.exec", "run a command inside a sandbox's workspace, recording its processes"),
    "doctor": ("controller.cli.doctor", "report what needs a person: stuck tombstones, holds, lapsing pins"),
    "uninstall": ("controller.cli.uninstall", "before `helm uninstall`: stop the agents and release every sandbox"),
}


def _parser(only: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandkeep", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sandkeep {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=None,
        help="text: logfmt lines (default); json: one JSON object per line (also $SANDKEEP_LOG_FORMAT)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(name, p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        logs.setup(args.log_level, log_format=args.log_format)
    except ValueError as err:  # $SANDKEEP_LOG_FORMAT names neither format
        print(f"sandkeep: {err} ($SANDKEEP_LOG_FORMAT)", file=sys.stderr)
        return 2
    for old, new in flags.deprecated_uses(args, os.environ).items():
        logs.say(log, "deprecated_spelling", level=logging.WARNING, used=old, use=new, until="the next release")
    module = importlib.import_module(COMMANDS[args.command][0])
    code: int = module.run(args.command, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
