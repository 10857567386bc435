"""Sizes for people, as the SIZE column and `sandkeep ls` show them."""

from __future__ import annotations

import pytest

from controller.sizes import human_size


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
