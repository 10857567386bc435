"""What the agent knows between passes: its node's objects (the watch's cache) and what it last saw."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from controller.agent.settings import AgentSettings
from controller.api.cache import Gone, Packed, supersedes
from controller.api.kube import Kube
from controller.node.inuse import Usage
from controller.node.store import Root
from controller.node.treesize import TreeSize
from controller.observe.metrics import AgentMetrics
from controller.rules.objects import Obj, key_of

Key = tuple[str, str]


def slim(obj: Obj) -> Obj:
    """Drop managedFields from a cached object: the agent never reads them, and with two status managers
    they are most of an object's size (10,000 cached objects is the memory budget's main item)."""
    obj.get("metadata", {}).pop("managedFields", None)
    return obj


@dataclass
class AgentState:
    objects: Packed[Key] = field(default_factory=Packed)  # each packed: 10,000 cached objects were 42 MiB as dicts
    usage: dict[Key, Usage] = field(default_factory=dict)
    present: set[Key] = field(default_factory=set)
    said: dict[str, tuple[float, str]] = field(default_factory=dict)  # rate-limited lines: subject -> (when, what)
    events: dict[tuple[str, str], str] = field(default_factory=dict)  # (uid, reason) -> message posted
    synced: bool = False
    gone: Gone = field(default_factory=Gone)  # uids seen deleted, oldest first (bounded)

    def remember(self, obj: Obj) -> None:
        """Keep the newest version of an object (a watch event can arrive after our own write's answer).

        An object already seen deleted is never kept again: the answer of a write sent before the deletion
        can arrive after the watch's DELETED, and a ghost in the cache would stop its directory from ever
        being adopted again (a new run retained under the same name). Which version is kept is the rule of both
        components' caches, `controller.api.cache.supersedes`."""
        slim(obj)
        key = key_of(obj)
        if supersedes(obj, self.objects.get(key), self.gone):
            self.objects[key] = obj

    def forget(self, obj: Obj) -> None:
        """Drop an object that is gone (deleted, or answered 404); a newer one of the same name stays."""
        key = key_of(obj)
        uid = obj["metadata"].get("uid")
        if uid:
            self.gone.add(uid)
        cached = self.objects.get(key)
        if cached is not None and cached["metadata"].get("uid") == uid:
            del self.objects[key]

    def newest(self, obj: Obj) -> Obj:
        """The cache's copy when it is the same object (our own status writes land there first)."""
        cached = self.objects.get(key_of(obj))
        return cached if cached is not None and cached["metadata"].get("uid") == obj["metadata"]["uid"] else obj


@dataclass(frozen=True)
class Shared:
    """What every part of the agent works with: the settings, the API client, the node's root, the metrics,
    the cache, and the sizes the background measurer last saw (bytes, files, complete, by sandbox)."""

    settings: AgentSettings
    kube: Kube
    root: Root
    metrics: AgentMetrics
    state: AgentState
    sizes: Callable[[], dict[Key, TreeSize]]
    owners: Callable[[], dict[Key, tuple[int, int]]] = dict  # (uid, gid) of each workspace, as last measured


class Part:
    """A part of the agent (adoption, reporting, relief): the shared things under short names."""

    def __init__(self, shared: Shared) -> None:
        self.s = shared.settings
        self.kube = shared.kube
        self.root = shared.root
        self.m = shared.metrics
        self.state = shared.state
        self.sizes = shared.sizes
        self.owners = shared.owners
