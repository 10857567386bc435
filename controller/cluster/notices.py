"""warnWebhook notices: one JSON POST per sandbox when it becomes ExpiringSoon, sent off the reconcile path.

A receiver is someone else's server: it may be down, slow or hang. So a notice is a task of its own, its HTTP
calls run on a few threads of their own (never the default executor the API calls use), each attempt has a
timeout, a failed one is retried after a bounded backoff, and the backlog of unsent notices is bounded: past
NOTICES_BACKLOG a new notice is dropped, counted and logged. Nothing here is awaited by a reconcile, so no
receiver delays a deletion. Logs name the receiver's host, never its path or query (a token may be there).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.error import HTTPError
from urllib.parse import urlsplit

from controller import __version__
from controller.cluster.events import Backlog
from controller.observe import logs
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.contracts import NoticeResult, Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.controller")
NOTICES_BACKLOG = 1000  # notices not yet sent or given up, at most (as many as the Events' backlog)
NOTICE_ATTEMPTS = 5  # tries of one notice; between them 1 s, 2 s, 4 s, 8 s: given up within about 15 s + 5 timeouts


def warn_notice(obj: Obj, status: Obj) -> Obj:
    """The JSON a warnWebhook receives for one sandbox: which, where, its deadline and why, from the status
    the controller just wrote (pure)."""
    meta, spec = obj["metadata"], obj.get("spec") or {}
    soon: Obj = next((cd for cd in status.get("conditions", []) if cd["type"] == c.Condition.EXPIRING_SOON), {})
    notice: Obj = {
        "kind": c.WARN_NOTICE_KIND,
        "apiVersion": c.API_VERSION,
        "namespace": meta["namespace"],
        "name": meta["name"],
        "uid": meta.get("uid"),
        "node": spec.get("nodeName"),
        "deadline": status.get("deadline"),
        "deadlineSource": status.get("deadlineSource"),
        "message": soon.get("message"),
    }
    if isinstance(spec.get("origin"), dict):
        notice["origin"] = spec["origin"]
    return notice


def host_of(url: str) -> str:
    """The receiver as logs may name it: host and port, without credentials, path or query."""
    return urlsplit(url).netloc.rpartition("@")[2]


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None  # a 3xx is an answer that is not 2xx: the notice failed, and is not posted elsewhere


_OPENER = urllib.request.build_opener(_NoRedirects)


def post(url: str, body: bytes, timeout: float) -> None:
    """One attempt: POST `body`; returns on a 2xx answer, raises otherwise (the timeout bounds each socket
    operation: connecting, sending, waiting for the answer's headers)."""
    if urlsplit(url).scheme not in ("http", "https"):  # the policy's parser refuses any other; never file: here
        raise ValueError("not an http or https URL")
    headers = {"Content-Type": "application/json", "User-Agent": f"sandkeep/{__version__}"}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 (checked above)
    with _OPENER.open(request, timeout=timeout) as answer:
        if not 200 <= answer.status < 300:
            raise OSError(f"HTTP {answer.status}")


def _words(err: Exception) -> str:
    """What went wrong, without the URL (urllib names it in some errors)."""
    if isinstance(err, HTTPError):
        return f"HTTP {err.code}"
    reason = getattr(err, "reason", None)
    return f"{type(err).__name__}: {reason if reason is not None else err}"[:200]


class Notices:
    """Sends warnWebhook notices in the background, each with retries, in a bounded backlog."""

    def __init__(self, metrics_: ControllerMetrics, timeout: float, backoff: float = 1.0) -> None:
        self.metrics = metrics_
        self.timeout = timeout
        self.backoff = backoff
        self.backlog = Backlog(NOTICES_BACKLOG)
        self._pool = ThreadPoolExecutor(4, "notices")

    def send(self, url: str, notice: Obj) -> None:
        """Queue `notice` for `url` and return at once; past NOTICES_BACKLOG unsent ones it is dropped."""
        name = f"{notice['namespace']}/{notice['name']}"
        if self.backlog.full():  # said once per run of drops, counted each time
            self._tell(NoticeResult.DROPPED, url, name, said=self.backlog.newly_full, backlog=NOTICES_BACKLOG)
            return
        delivery = self._deliver(url, json.dumps(notice).encode(), name)
        self.backlog.track(asyncio.get_running_loop().create_task(delivery))

    async def _deliver(self, url: str, body: bytes, name: str) -> None:
        loop, error = asyncio.get_running_loop(), ""
        for attempt in range(1, NOTICE_ATTEMPTS + 1):
            try:
                await loop.run_in_executor(self._pool, post, url, body, self.timeout)
            except Exception as err:  # any failure of someone else's server is the notice's, never the loop's
                error = _words(err)
            else:
                self._tell(NoticeResult.SENT, url, name, attempts=attempt)
                return
            if attempt == NOTICE_ATTEMPTS:
                break
            delay = self.backoff * 2 ** (attempt - 1)
            self._tell(NoticeResult.RETRIED, url, name, attempt=attempt, error=error, retry_in=f"{delay:g}s")
            await asyncio.sleep(delay)
        self._tell(NoticeResult.FAILED, url, name, attempts=NOTICE_ATTEMPTS, error=error)

    def _tell(self, result: NoticeResult, url: str, name: str, *, said: bool = True, **fields: object) -> None:
        """Count a result and log it (`warn_notice_<result>`), naming the receiver by its host alone."""
        self.metrics.warn_notices.labels(result=result).inc()
        if said:
            level = logging.INFO if result is NoticeResult.SENT else logging.WARNING
            host = host_of(url)
            logs.say(
                log, f"warn_notice_{result}", level=level, reason=Reason.EXPIRING_SOON, object=name, host=host, **fields
            )
