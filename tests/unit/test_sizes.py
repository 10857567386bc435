"""Sizes for people, as the SIZE column and `sandkeep ls` show them."""

from __future__ import annotations

import pytest

from controller.rules.durations import Invalid
from controller.rules.sizes import MAX_BYTES, human_size, parse_size


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0K"),
        (3 * 1024**3 // 2, "1.5G"),
        (1024**4 * 5, "5.0T"),
        (1024**5, "1024.0T"),
        (-1, "0B"),
    ],
)
def test_sizes_read_like_du_h(size: int, shown: str) -> None:
    assert human_size(size) == shown


def test_the_column_schema_allows_every_size_a_disk_can_hold() -> None:
    assert len(human_size(2**63 - 1)) <= 16  # the CRD's status.size maxLength


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("500Mi", 500 * 1024**2), ("50Gi", 50 * 1024**3), ("2T", 2 * 10**12), ("8k", 8000), (0, 0)],
)
def test_a_quota_size_reads_as_kubernetes_writes_quantities(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.5G", "5 G", "5g", "５G", "-1", -1, "", None, True, "1e9", "9999999999999999999Pi"])
def test_a_size_that_is_not_a_byte_count_is_invalid_and_says_so(text: object) -> None:
    parsed = parse_size(text)
    assert isinstance(parsed, Invalid) and parsed.why


def test_the_largest_size_is_what_a_kubernetes_int64_holds() -> None:
    assert parse_size(str(MAX_BYTES)) == MAX_BYTES
    assert isinstance(parse_size(str(MAX_BYTES + 1)), Invalid)
