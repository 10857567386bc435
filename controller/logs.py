"""One structured line per decision: `event reason=Code key=value ...` (logfmt), greppable by reason code.

Every component logs through `say`, so a person can find a whole family of decisions with one grep
(`grep reason=TombstoneStuck`) across the controller, the agent and the standalone sweep.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

_SECRET_HINTS = ("token", "password", "secret", "authorization", "bearer")


def _value(key: str, value: Any) -> str:
    if any(hint in key.lower() for hint in _SECRET_HINTS):
        return "<redacted>"
    text = str(value.value if hasattr(value, "value") else value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def fields(**kv: Any) -> str:
    """Render key=value pairs in logfmt, dropping None and redacting anything that looks like a secret."""
    return " ".join(f"{k}={_value(k, v)}" for k, v in kv.items() if v is not None)


def say(logger: logging.Logger, event: str, *, level: int = logging.INFO, **kv: Any) -> None:
    """Log `event` with its fields as one line; `reason=` should be a `contracts.Reason`."""
    logger.log(level, "%s %s", event, fields(**kv))


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname.lower():5} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str | None = None, extra: Mapping[str, str] | None = None) -> None:
    """Configure the root logger once for a sandkeep process (stderr, UTC, logfmt)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("SANDKEEP_LOG_LEVEL", "INFO")).upper())
    for noisy in ("kubernetes", "urllib3", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, value in (extra or {}).items():
        logging.getLogger(name).setLevel(value)
