"""Parsing of human input: durations (`90m`, `72h`, `3d`, `2w`, `1h30m`) and RFC 3339 instants.

Neither parser raises: each returns the value or an `Invalid` that says what was wrong, so bad input
from an annotation, a manifest or a flag becomes a condition or a message, never a crash. Both are
total: ASCII digits only (as the CRD's patterns), whole-string matches, and every value they return is
inside bounds such that `instant + duration` cannot overflow; `shift` makes any other sum total too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

# Seconds per unit, summed as int: a timedelta sum overflows at 999999999w before it can be compared.
_UNITS = dict(w=604800, d=86400, h=3600, m=60, s=1)
# [0-9], not \d: `\d` also matches `３` or `٣`, which int() reads and the CRD's pattern refuses.
_DURATION = re.compile(r"(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")
# A bound well inside datetime's range, so `now + duration` can never overflow.
MAX_DURATION = timedelta(days=100 * 365)
# RFC 3339 date-time: a 'T' (or space), seconds present, optional fraction, and an explicit zone whose
# offset is 00:00 to 23:59 (Python reads `+00:99` as +01:39; RFC 3339 and the chart's pin policy refuse it).
_INSTANT = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
    r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_SPACE = " \t\r\n"  # what is trimmed around input: ASCII whitespace only, like the digits
# The instants sandkeep accepts: anything outside is a typo or an attack, never a real job's time, and
# inside them `instant +- MAX_DURATION` is always a datetime (year 1 or 9999 with an offset is not).
MIN_INSTANT = datetime(1970, 1, 1, tzinfo=UTC)
MAX_INSTANT = datetime(9000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Invalid:
    """Input that could not be parsed: the text as given and why, in words a person can act on."""

    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.text!r}: {self.why}"


def parse_duration(text: object) -> timedelta | Invalid:
    """`90m`, `72h`, `3d`, `2w`, `1h30m`, `45s` or `0` -> timedelta; anything else -> Invalid."""
    raw = str(text).strip(_SPACE) if text is not None else ""
    if raw == "0":
        return timedelta(0)
    match = _DURATION.fullmatch(raw.lower())
    if not raw or not match or not any(match.groups()):
        return Invalid(raw, "not a duration; use a number with a unit: 90m, 72h, 3d, 2w (or 1h30m)")
    seconds = 0
    for amount, unit in zip(match.groups(), "wdhms", strict=True):
        if amount is not None:
            if len(amount) > 9:
                return Invalid(raw, f"too large; at most {MAX_DURATION.days}d")
            seconds += int(amount) * _UNITS[unit]
    if seconds > MAX_DURATION.total_seconds():
        return Invalid(raw, f"too large; at most {MAX_DURATION.days}d")
    return timedelta(seconds=seconds)


def parse_instant(text: object) -> datetime | Invalid:
    """An RFC 3339 date-time with an explicit zone (`2026-12-01T10:00:00Z`) -> aware UTC datetime."""
    raw = str(text).strip(_SPACE) if text is not None else ""
    if not _INSTANT.fullmatch(raw):
        return Invalid(raw, "not an RFC 3339 time with a zone, e.g. 2026-12-01T10:00:00Z")
    body = raw.replace("z", "Z").replace("t", "T")
    # Python takes at most 6 fractional digits; RFC 3339 allows more (Kubernetes writes up to 9).
    body = re.sub(r"(\.[0-9]{6})[0-9]+", r"\1", body)
    try:
        when = datetime.fromisoformat(body).astimezone(UTC)
    except ValueError as err:
        return Invalid(raw, f"not a real date or time ({err})")
    except OverflowError:  # 0001-01-01T00:00:00+01:00 is a valid text for an instant before year 1
        when = None
    if when is None or not MIN_INSTANT <= when <= MAX_INSTANT:
        return Invalid(raw, f"out of range; sandkeep takes times from {MIN_INSTANT.year} to {MAX_INSTANT.year}")
    return when


def instant_or_none(value: object) -> datetime | None:
    """A time read from an object or a file (`createdAt`, a Lease's `renewTime`): the instant, or None when
    the value is absent, not a string, or not a valid RFC 3339 time. Total: it never raises."""
    parsed = parse_instant(value) if isinstance(value, str) else None
    return parsed if isinstance(parsed, datetime) else None


def shift(when: datetime, delta: timedelta) -> datetime:
    """`when + delta`, total: a sum past datetime's range saturates at its end instead of raising."""
    try:
        return when + delta
    except OverflowError:
        edge = datetime.max if delta > timedelta(0) else datetime.min
        return edge.replace(tzinfo=when.tzinfo)


def format_instant(when: datetime) -> str:
    """The canonical form sandkeep writes: UTC, whole seconds, `Z`. Total: an aware time at the very edge of
    datetime's range (year 1 at +14:00) has no UTC inside it, and is written as that edge."""
    try:
        utc = when.astimezone(UTC)
    except OverflowError:
        utc = (datetime.min if when.year == datetime.min.year else datetime.max).replace(tzinfo=UTC)
    return utc.replace(microsecond=0, tzinfo=None).isoformat() + "Z"


def format_duration(delta: timedelta) -> str:
    """A short human form (`3d4h`, `12m`, `-5s`) for tables and messages."""
    seconds = int(delta.total_seconds())
    sign, seconds = ("-", -seconds) if seconds < 0 else ("", seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            amount, seconds = divmod(seconds, size)
            parts.append(f"{amount}{unit}")
        if len(parts) == 2:
            break
    return sign + "".join(parts)
