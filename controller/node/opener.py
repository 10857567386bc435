"""Whether a sandbox may be opened: the node-side opener's refusals (`sandkeep exec`), one pure decision.

`refusal()` is asked twice by `sandkeep exec`: before the command starts, and again right after it
started (the post-launch look, with the workspace it was started in), since a sweep that passed its
in-use check before the command existed may still rename the sandbox aside. It reads what the caller
read (the manifest, the tombstones that name this sandbox, two inode identities) and `now`; no I/O.

Expiry is `expiry()`, the sweep's own question of the one rule (`policy.deadline`), with the policy
the standalone `ls` and `sweep` build from the same flags, so what `ls` calls Expired `exec` refuses.
A sandbox retained for a cluster node (`--node`, `ClusterOwned`) is judged the same way, on its
manifest: its pins and a deletion asked on its RetainedSandbox live in the API, which a node-side
command cannot see. That fails closed for a cluster pin past the manifest's deadline (refused, and
said so); a deletion asked in the cluster is not seen, but the agent never renames a sandbox while a
command works in it, and one that slips between its check and its rename is the post-launch look's.
The root lock is not asked: the agent (and a `sweep --interval`) hold it for their whole life.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from controller.node.store import Absent, Mismatch, Present, Read, Refusal, Tombstone, Transient, Unparsed, Unreadable
from controller.rules.contracts import Reason
from controller.rules.durations import format_duration, format_instant
from controller.rules.policy import Policy, Verdict, deadline

Ident = tuple[int, int]  # (st_dev, st_ino)


def expiry(read: Read, policy: Policy, now: datetime, newer: int | None = None) -> tuple[Reason | None, Verdict | None]:
    """The cause to delete on, or (None, verdict) to keep. No usable manifest is expired, as in the reference.
    `newer`: how many of its history group and outcome are newer (the sweep's count; None: in no group)."""
    if isinstance(read, Present):
        verdict = deadline(read.manifest.facts(newer), policy, now)
        if not verdict.expired:
            return None, verdict
        return (verdict.reasons[-1] if verdict.reasons else Reason.EXPIRED), verdict
    if isinstance(read, Absent):
        return read.reason, None
    if isinstance(read, Unparsed | Unreadable):
        return read.reason, None
    return Reason.EXPIRED, None


@dataclass(frozen=True)
class Remains:
    """A tombstone and the read of the manifest inside it (it keeps the namespace/name it was under)."""

    tombstone: Tombstone
    read: Read

    def names(self, namespace: str, name: str) -> bool:
        """It is a deletion of `namespace/name`: a staging directory of a retain is not one."""
        read = self.read
        if self.tombstone.id.endswith("-stage") or not isinstance(read, Present | Mismatch):
            return False
        return (read.manifest.namespace, read.manifest.name) == (namespace, name)


@dataclass(frozen=True)
class Opening:
    """What the opener read about one sandbox: `ref` (`ns/name`) under `root` (for the words), the
    manifest read, the tombstones of the root with their reads (only needed when the read is not a
    manifest), and after launch the identity of the workspace the command was started in (`held`) and
    of the one at the sandbox's path now (`found`, None when it cannot be opened)."""

    ref: str
    root: str
    read: Read
    remains: Sequence[Remains] = ()
    held: Ident | None = None
    found: Ident | None = None

    @property
    def where(self) -> str:
        return f"{self.root}/{self.ref}"


def refusal(opening: Opening, policy: Policy, now: datetime, *, stuck_after: timedelta) -> Refusal | None:
    """Why the sandbox must not be opened (or, after launch, must not stay open), or None to go ahead.

    In order: a sandbox whose name holds no manifest is being deleted when a tombstone holds its manifest
    (`Tombstoned`; `TombstoneStuck` once older than `stuck_after`; `TombstonePinned` when it holds a live
    pin, which the next sweep puts back), else lost or unreadable (the read's own reason); a manifest
    that names another sandbox is refused; an expired one (the one rule, `expiry`) is `Expired`; after
    launch, a workspace that is no longer the one the command was started in was swept and replaced
    meanwhile (`Replaced`). Recorded orphans that survive are the reaper's refusal (`ReapResult.hold`).
    """
    read, where = opening.read, opening.where
    if isinstance(read, Mismatch):
        names = f"{read.manifest.namespace}/{read.manifest.name}"
        return Refusal(
            read.reason,
            f"its manifest names another sandbox ({names}), so nothing here is trusted",
            f"Look at {where}/manifest.json: move the directory where it belongs, or retain it again",
        )
    if not isinstance(read, Present):
        return _not_here(opening, policy, now, stuck_after)
    cause, verdict = expiry(read, policy, now)
    if cause is not None:
        return _expired(opening, read, cause, verdict, policy)
    if opening.held is not None and opening.found != opening.held:
        return Refusal(
            Reason.REPLACED,
            "the workspace the command was started in is no longer this sandbox's: it was swept and another was "
            "retained under the name meanwhile",
            f"Run the command again to work in the sandbox now at {where}",
        )
    return None


def _not_here(opening: Opening, policy: Policy, now: datetime, stuck_after: timedelta) -> Refusal:
    namespace, _, name = opening.ref.partition("/")
    for r in opening.remains:
        if not r.names(namespace, name):
            continue
        t, age = r.tombstone, format_duration(r.tombstone.age(now))
        verdict = deadline(r.read.manifest.facts(), policy, now) if isinstance(r.read, Present) else None
        if verdict is not None and verdict.pinned and not verdict.expired:
            return Refusal(
                Reason.TOMBSTONE_PINNED,
                f"it was renamed aside for deletion ({t.name}, {age} ago) but holds a live pin, so the next sweep "
                "puts it back",
                "Run the command again once it is back (`sandkeep ls` lists it)",
            )
        if t.age(now) >= stuck_after:
            return Refusal(
                Reason.TOMBSTONE_STUCK,
                f"it is being deleted and its tombstone {t.path} is stuck ({age} old, stuck after "
                f"{format_duration(stuck_after)})",
                "Nothing can be opened in it any more; copy out what you need from the tombstone and see "
                "docs/runbooks.md for a stuck tombstone",
            )
        return Refusal(
            Reason.TOMBSTONED,
            f"it is being deleted: renamed aside to {t.path} {age} ago",
            "Nothing can be opened in it any more; copy out what you still need from the tombstone now",
        )
    read = opening.read
    if isinstance(read, Transient):
        return Refusal(read.reason, f"its manifest could not be read just now ({read.errno})", "Retry in a moment")
    return Refusal(
        read.reason,
        f"it has no readable manifest at {opening.where} ({read.reason})",
        "Run `sandkeep ls` to see the sandboxes of this root",
    )


def _expired(opening: Opening, read: Present, cause: Reason, verdict: Verdict | None, policy: Policy) -> Refusal:
    namespace, _, name = opening.ref.partition("/")
    when = f"since {format_instant(verdict.deadline)}" if verdict and verdict.deadline else "(no usable createdAt)"
    why = f"it is expired {when} ({cause}, retention {format_duration(policy.retention)}), so the sweep deletes it"
    node = read.manifest.node
    if node:
        why += (
            f"; it was retained for node {node}, whose pins live on its RetainedSandbox, which this node-side "
            "command cannot see: it is judged on its manifest, as `sandkeep ls` shows it"
        )
        return Refusal(
            Reason.EXPIRED,
            why,
            f"Copy out what you need from {opening.where}/{read.manifest.workspace} (`kubectl get rsb -n {namespace} "
            f"{name}` shows its deadline in the cluster)",
        )
    return Refusal(
        Reason.EXPIRED,
        why,
        f"Pin it first (`sandkeep pin {opening.ref} --root {opening.root} --for 24h`) and run the command again, "
        f"or copy out what you need from {opening.where}/{read.manifest.workspace}",
    )
