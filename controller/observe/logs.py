"""One structured line per decision: `event reason=Code key=value ...` (logfmt), greppable by reason code.

Every component logs through `say`, so a person can find a whole family of decisions with one grep
(`grep reason=TombstoneStuck`) across the controller, the agent and the standalone sweep.
`--log-format json` writes the same decisions as one JSON object per line (`event`, `reason` and the
same fields, secrets redacted the same way) for log pipelines that parse JSON, as kopf's and
cert-manager's do.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

FORMATS = ("text", "json")
_SECRET_HINTS = ("token", "password", "secret", "authorization", "bearer")
_REDACTED = "<redacted>"
_EVENT = "sandkeep_event"  # LogRecord attributes `say` sets, read back by the JSON formatter
_FIELDS = "sandkeep_fields"


def _secret(key: str) -> bool:
    return any(hint in key.lower() for hint in _SECRET_HINTS)


def _plain(value: Any) -> Any:
    """An enum as its value (reason codes), JSON's own scalars as they are, anything else as text."""
    value = value.value if hasattr(value, "value") else value
    return value if isinstance(value, str | int | float | bool) else str(value)


def _value(key: str, value: Any) -> str:
    if _secret(key):
        return _REDACTED
    text = str(_plain(value))
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def fields(**kv: Any) -> str:
    """Render key=value pairs in logfmt, dropping None and redacting anything that looks like a secret."""
    return " ".join(f"{k}={_value(k, v)}" for k, v in kv.items() if v is not None)


def say(logger: logging.Logger, event: str, *, level: int = logging.INFO, **kv: Any) -> None:
    """Log `event` with its fields as one line; `reason=` should be a `contracts.Reason`."""
    if not logger.isEnabledFor(level):
        return
    kept = {k: v for k, v in kv.items() if v is not None}
    logger.log(level, "%s %s", event, fields(**kept), extra={_EVENT: event, _FIELDS: kept})


def _stamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_stamp(record)} {record.levelname.lower():5} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, then `event` and the fields of a `say`, or
    `message` for any other record (kopf's, libraries'); a traceback goes in `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time": _stamp(record), "level": record.levelname.lower(), "logger": record.name}
        event = getattr(record, _EVENT, None)
        if event is None:
            line["message"] = record.getMessage()
        else:
            line["event"] = event
            for key, value in (getattr(record, _FIELDS, None) or {}).items():
                shown = _REDACTED if _secret(key) else _plain(value)
                line[f"{key}_" if key in line else key] = shown
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup(level: str | None = None, extra: Mapping[str, str] | None = None, log_format: str | None = None) -> None:
    """Configure the root logger once for a sandkeep process (stderr, UTC; logfmt text or JSON lines).

    The format comes from `log_format`, else $SANDKEEP_LOG_FORMAT, else text; anything else is refused.
    """
    chosen = (log_format or os.environ.get("SANDKEEP_LOG_FORMAT") or "text").lower()
    if chosen not in FORMATS:
        raise ValueError(f"log format {chosen!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else _Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("SANDKEEP_LOG_LEVEL", "INFO")).upper())
    for noisy in ("kubernetes", "urllib3", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, value in (extra or {}).items():
        logging.getLogger(name).setLevel(value)
