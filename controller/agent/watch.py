"""The agent's watch: its node's RetainedSandboxes through `listwatch.ListWatch`, with the API server
filtering on `spec.nodeName=<node>` (a selectable field of the CRD), so other nodes' objects never arrive.

The listing says when it is complete (`synced`): the first pass must not adopt, as new, directories
whose objects simply have not arrived yet, so passes wait for it. The watch starts from the listing's
resourceVersion, so nothing changes unseen in between; after a 410 Gone the new listing says which
objects vanished while the watch was down, and the runtime forgets them (`Agent._listed`).
"""

from __future__ import annotations

from collections.abc import Callable

from controller.api import listwatch
from controller.api.kube import Kube, sandbox_path
from controller.rules.objects import Obj


def sandboxes(
    kube: Kube,
    node: str,
    on_event: Callable[[str | None, Obj], None],
    listed: Callable[[set[tuple[str, str]]], None],
) -> listwatch.ListWatch:
    """This node's objects, listed in pages and then watched; each event handed to `on_event`."""
    return listwatch.ListWatch(kube, sandbox_path(), on_event, listed, query={"fieldSelector": f"spec.nodeName={node}"})
