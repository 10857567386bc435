"""The controller's Events, posted in the background: Events report decisions, they never delay them.

A wave of similar Events (a mass expiry: the same reason and words in one namespace) is aggregated, as
client-go's EventCorrelator aggregates the kubelet's: the first `AGGREGATE_AFTER` of a window of
`AGGREGATE_WINDOW` seconds go out one by one, the rest are folded into one Event at the window's end that
counts and names them (docs/benchmarks.md: at a mass expiry this was one request in three).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from controller.api.kube import Kube
from controller.cluster.settings import COMPONENT
from controller.observe import logs
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.controller")
EVENTS_BACKLOG = 1000  # Events waiting to be posted, at most (client-go's broadcaster queue holds as many)
AGGREGATE_AFTER = 10  # similar Events posted one by one in a window (client-go's aggregator: 10)
AGGREGATE_WINDOW = 10.0  # seconds of a window; the similar Events past the first ones go out as one at its end
_NAMES = 900  # characters of names an aggregated Event lists, at most (a message holds 1,024)


class Backlog(set[asyncio.Future[None]]):
    """Work sent off the loop and not finished yet, at most `limit`: past it a new one is dropped (`full`), and
    `newly_full` says whether it is the first drop of a run, the one to log (the Events' and the notices')."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.newly_full = False
        self._dropping = False

    def full(self) -> bool:
        full = len(self) >= self.limit
        self.newly_full = full and not self._dropping
        self._dropping = full
        return full

    def track(self, future: asyncio.Future[None]) -> None:
        self.add(future)
        future.add_done_callback(self.discard)


@dataclass
class _Wave:
    """Similar Events of one window: how many went one by one, and the rest, folded (names up to `_NAMES`)."""

    start: float
    singles: int = 0
    first: Obj | None = None  # the first folded one's reference: the aggregated Event's involvedObject
    folded: int = 0
    names: list[str] = field(default_factory=list)
    chars: int = 0


class Events:
    """Posts Events off the loop, on a few threads of their own: under load they queue there, never in
    front of a DELETE."""

    def __init__(self, kube: Kube, metrics_: ControllerMetrics) -> None:
        self.kube = kube
        self.metrics = metrics_
        self.backlog = Backlog(EVENTS_BACKLOG)
        self._pool = ThreadPoolExecutor(4, "events")
        self.waves: dict[tuple[str, Reason, str, str], _Wave] = {}  # (namespace, reason, type, words)

    def post(self, obj: Obj, reason: Reason, message: str, type_: str, *, similar: str | None = None) -> None:
        """Post an Event in the background; with `similar` (words it shares with a wave of such Events, e.g.
        "expired (Window); delete requested"), past `AGGREGATE_AFTER` in a window it is folded into that
        window's aggregated Event instead.

        The backlog is bounded, as client-go's event broadcaster bounds its own: past EVENTS_BACKLOG
        unsent Events (a mass expiry on a slow API server) a new one is dropped and counted, so memory
        does not grow with the size of the wave.
        """
        if similar is not None and self._fold(obj, reason, type_, similar):
            return
        self._send(_ref(obj), reason, message, type_)

    def _fold(self, obj: Obj, reason: Reason, type_: str, similar: str) -> bool:
        """Count `obj` in its wave: False while the window's singles last (post it), True once folded."""
        meta = obj["metadata"]
        key = (meta.get("namespace") or "", reason, type_, similar)
        now = time.monotonic()
        wave = self.waves.get(key)
        if wave is None or (not wave.folded and now - wave.start >= AGGREGATE_WINDOW):
            if len(self.waves) >= EVENTS_BACKLOG:  # many namespaces: forget the windows nothing is folded in
                self.waves = {k: w for k, w in self.waves.items() if w.folded}
            wave = self.waves[key] = _Wave(now)
        if wave.singles < AGGREGATE_AFTER:
            wave.singles += 1
            return False
        if not wave.folded:
            wave.first = _ref(obj)
            asyncio.get_running_loop().call_later(max(0.0, wave.start + AGGREGATE_WINDOW - now), self._flush, key)
        wave.folded += 1
        name = str(meta.get("name"))
        if wave.chars + len(name) <= _NAMES:
            wave.names.append(name)
            wave.chars += len(name) + 2
        return True

    def _flush(self, key: tuple[str, Reason, str, str]) -> None:
        """A window's end: one Event for what was folded in it, counted and named."""
        wave = self.waves.pop(key)
        namespace, reason, type_, similar = key
        assert wave.first is not None
        rest = wave.folded - len(wave.names)
        names = ", ".join(wave.names) + (f" and {rest} more" if rest else "")
        seconds = time.monotonic() - wave.start
        message = (
            f"(combined from similar events): {wave.folded} more in {namespace} in {seconds:.0f}s, {similar}: {names}"
        )
        self._send(wave.first, reason, message, type_)

    def folding(self) -> bool:
        """An aggregated Event is still to be posted (for tests and the benchmark)."""
        return any(wave.folded for wave in self.waves.values())

    def _send(self, ref: Obj, reason: Reason, message: str, type_: str) -> None:
        if self.backlog.full():
            self.metrics.events_dropped.inc()
            if self.backlog.newly_full:
                logs.say(log, "events_dropped", level=logging.WARNING, reason=reason, backlog=EVENTS_BACKLOG)
            return
        loop, post = asyncio.get_running_loop(), self.kube.post_event
        self.backlog.track(loop.run_in_executor(self._pool, post, ref, reason, message, type_, COMPONENT))


def _ref(obj: Obj) -> Obj:
    """Only what involvedObject needs: a backlog of 10,000 Events must not hold 10,000 whole objects."""
    meta = obj["metadata"]
    return {
        "apiVersion": obj.get("apiVersion", c.API_VERSION),
        "kind": obj.get("kind", c.SANDBOX_KIND),
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
    }
