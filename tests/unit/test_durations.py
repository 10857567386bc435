"""Human input: durations (`90m`, `72h`, `3d`, `2w`) and RFC 3339 instants. Bad input is a value, never a raise."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.rules.durations import (
    MAX_DURATION,
    MAX_INSTANT,
    MIN_INSTANT,
    Invalid,
    format_duration,
    format_instant,
    instant_or_none,
    parse_duration,
    parse_instant,
    shift,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90m", timedelta(minutes=90)),
        ("72h", timedelta(hours=72)),
        ("3d", timedelta(days=3)),
        ("2w", timedelta(weeks=2)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("45s", timedelta(seconds=45)),
        ("0", timedelta(0)),
        (" 72h ", timedelta(hours=72)),
        ("72H", timedelta(hours=72)),
    ],
)
def test_durations_people_write_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "x", "3x", "-1h", "1.5h", "h", "72", "m30", "1h 30m", None, "3d2w"])
def test_bad_durations_are_invalid_with_the_text_and_a_hint(text: object) -> None:
    result = parse_duration(text)
    assert isinstance(result, Invalid)
    assert "90m, 72h, 3d, 2w" in str(result)


def test_a_duration_beyond_a_century_is_refused_so_now_plus_it_cannot_overflow() -> None:
    assert isinstance(parse_duration("9999999999d"), Invalid)
    assert isinstance(parse_duration(f"{MAX_DURATION.days + 1}d"), Invalid)
    assert parse_duration(f"{MAX_DURATION.days}d") == MAX_DURATION


@given(st.text(max_size=30))
def test_parse_duration_never_raises(text: str) -> None:
    result = parse_duration(text)
    assert isinstance(result, Invalid) or timedelta(0) <= result <= MAX_DURATION


@given(st.lists(st.tuples(st.integers(0, 10**10), st.sampled_from("wdhmsWDHMS")), min_size=1, max_size=5))
def test_parse_duration_never_raises_on_any_amount_of_any_unit(parts: list[tuple[int, str]]) -> None:
    # `999999999w` raised OverflowError (a timedelta of more than 999999999 days) instead of "too large".
    result = parse_duration("".join(f"{amount}{unit}" for amount, unit in parts))
    assert isinstance(result, Invalid) or timedelta(0) <= result <= MAX_DURATION


def test_nine_digits_of_weeks_are_too_large_not_an_overflow() -> None:
    result = parse_duration("999999999w")
    assert isinstance(result, Invalid) and result.why == f"too large; at most {MAX_DURATION.days}d"


@given(st.integers(min_value=0, max_value=MAX_DURATION.days * 86400))
def test_a_formatted_whole_duration_of_one_unit_parses_back(seconds: int) -> None:
    # format_duration keeps the two largest units: exact whenever the duration has at most two.
    delta = timedelta(seconds=seconds - seconds % 3600)
    text = format_duration(delta)
    if text.count("d") + text.count("h") + text.count("m") + text.count("s") <= 2:
        assert parse_duration(text) == delta


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-01T10:00:00Z", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01t10:00:00z", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01T10:00:00+02:00", datetime(2026, 12, 1, 8, tzinfo=UTC)),
        ("2026-12-01T10:00:00.5Z", datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=UTC)),
        ("2026-12-01T10:00:00.123456789Z", datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)),
    ],
)
def test_rfc3339_instants_parse_to_aware_utc(text: str, expected: datetime) -> None:
    result = parse_instant(text)
    assert result == expected
    assert isinstance(result, datetime) and result.tzinfo is not None


@pytest.mark.parametrize(
    "text",
    ["2026-12-01", "2026-12-01T10:00:00", "2026-12-01T10:00Z", "now", "", None, "2026-02-30T10:00:00Z", "tomorrow"],
)
def test_bad_instants_are_invalid_and_say_what_is_expected(text: object) -> None:
    result = parse_instant(text)
    assert isinstance(result, Invalid)
    assert "RFC 3339" in result.why or "not a real date" in result.why


@pytest.mark.parametrize("zone", ["+00:60", "+00:99", "-12:75", "+24:00", "-99:00"])
def test_a_zone_offset_past_23_59_is_not_rfc3339(zone: str) -> None:
    # Python read `+00:99` as +01:39; RFC 3339 (and the chart's pin policy) allow 00-23 and 00-59 only.
    assert isinstance(parse_instant(f"2026-12-01T10:00:00{zone}"), Invalid)
    assert parse_instant("2026-12-01T10:00:00+23:59") == datetime(2026, 11, 30, 10, 1, tzinfo=UTC)


@given(st.text(max_size=40))
def test_parse_instant_never_raises(text: str) -> None:
    result = parse_instant(text)
    assert isinstance(result, Invalid | datetime)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "yesterday",
        "2026-13-01T00:00:00Z",
        "2026-12-01T10:00:00",
        "0001-01-01T00:00:00+01:00",
        1764583200,
        1764583200.0,
        ["2026-12-01T10:00:00Z"],
        {"at": "2026-12-01T10:00:00Z"},
        b"2026-12-01T10:00:00Z",
    ],
)
def test_instant_or_none_is_none_for_anything_but_a_valid_time(value: object) -> None:
    assert instant_or_none(value) is None


def test_instant_or_none_reads_what_kubernetes_writes() -> None:
    expected = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
    assert instant_or_none("2026-12-01T10:00:00.123456789Z") == expected
    assert instant_or_none(" 2026-12-01t11:00:00.123456+01:00 ") == expected
    assert instant_or_none("2026-12-01T10:00:00Z") == expected.replace(microsecond=0)


@given(st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=40), st.text(max_size=40)))
def test_instant_or_none_never_raises_and_agrees_with_parse_instant(value: object) -> None:
    result = instant_or_none(value)
    if isinstance(value, str) and isinstance(parse_instant(value), datetime):
        assert result == parse_instant(value) and result.tzinfo == UTC
    else:
        assert result is None


@given(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9000, 1, 1), timezones=st.just(UTC)))
def test_format_instant_round_trips_to_the_second(when: datetime) -> None:
    text = format_instant(when)
    assert text.endswith("Z")
    assert parse_instant(text) == when.replace(microsecond=0)


def test_format_duration_is_short_and_signed() -> None:
    assert format_duration(timedelta(days=3, hours=4, minutes=5)) == "3d4h"
    assert format_duration(timedelta(minutes=12)) == "12m"
    assert format_duration(timedelta(seconds=-5)) == "-5s"
    assert format_duration(timedelta(0)) == "0s"


# --- hostile input (issue 12, items 4 and 10) -------------------------------------------------------------


@pytest.mark.parametrize("text", ["３h", "٣d", "1h３0m", "72h\u2003", "\u00a072h", "72h\nx"])
def test_durations_take_ascii_digits_and_spaces_only_as_the_crd_pattern_does(text: str) -> None:
    assert isinstance(parse_duration(text), Invalid)


@pytest.mark.parametrize(
    "text",
    ["２０２６-12-01T10:00:00Z", "2026-12-01T10:00:00Z\nx", "2026-12-01T10:00:00Z\u2003", "2026-12-01T1٠:00:00Z"],
)
def test_instants_take_ascii_digits_and_whole_strings_only(text: str) -> None:
    assert isinstance(parse_instant(text), Invalid)


@pytest.mark.parametrize(
    "text",
    [
        "0001-01-01T00:00:00+01:00",  # before year 1 in UTC: OverflowError escaped, decide() raised forever
        "9999-12-31T23:00:00-01:00",  # after year 9999 in UTC
        "9999-12-31T23:00:00Z",  # representable, but `+ retention` is not: `sandkeep ls` died on it
        "1969-12-31T23:59:59Z",
        "0000-01-01T00:00:00Z",
    ],
)
def test_an_instant_out_of_range_is_invalid_and_says_so(text: str) -> None:
    result = parse_instant(text)
    assert isinstance(result, Invalid)
    assert "out of range" in result.why or "not a real date" in result.why


@given(
    st.from_regex(
        r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,12})?([Zz]|[+-][0-9]{2}:[0-9]{2})\Z"
    )
)
def test_every_rfc3339_shaped_text_parses_in_range_or_is_invalid(text: str) -> None:
    result = parse_instant(text)
    assert isinstance(result, Invalid) or MIN_INSTANT <= result <= MAX_INSTANT


@given(
    st.datetimes(min_value=MIN_INSTANT.replace(tzinfo=None), max_value=MAX_INSTANT.replace(tzinfo=None)),
    st.timedeltas(min_value=-MAX_DURATION, max_value=MAX_DURATION),
)
def test_an_accepted_instant_plus_an_accepted_duration_never_overflows(when: datetime, delta: timedelta) -> None:
    when = when.replace(tzinfo=UTC)
    assert shift(when, delta) == when + delta


@given(st.datetimes(timezones=st.just(UTC)), st.timedeltas())
def test_shift_is_total_and_saturates(when: datetime, delta: timedelta) -> None:
    moved = shift(when, delta)
    assert moved.tzinfo is UTC
    assert (moved >= when) if delta >= timedelta(0) else (moved <= when)


def test_format_instant_is_total_at_the_edges_of_datetimes_range() -> None:
    # Found by the rule's property test: year 1 at +14:00 is before UTC's year 1.
    assert format_instant(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14)))) == "0001-01-01T00:00:00Z"
    late = datetime(9999, 12, 31, 23, 59, tzinfo=timezone(-timedelta(hours=12)))
    assert format_instant(late) == "9999-12-31T23:59:59Z"
    assert format_instant(datetime(2026, 12, 2, 18, 0, 5, 999, tzinfo=UTC)) == "2026-12-02T18:00:05Z"
