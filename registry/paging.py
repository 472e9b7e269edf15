"""Listings a page at a time: one page size for the API and the pages, and keyset pages (`after` the last
row of the page before), read in a fixed number of queries whatever the table holds.

A listing filtered by what SQL cannot say (a token's fnmatch patterns) reads at most `MAX_SCANS` chunks
per page: a page may then hold fewer rows than asked, with a cursor to go on from the last row read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

PAGE_LIMIT = 100  # rows a listing answers unless asked for fewer or more
MAX_PAGE_LIMIT = 1000
MAX_SCANS = 5  # chunks a filtered page reads at most
SCAN_CHUNK = 200  # rows a filtered page reads at a time, at least

Row = TypeVar("Row")
Cursor = TypeVar("Cursor")


@dataclass(frozen=True)
class Page(Generic[Row, Cursor]):
    """Rows of a listing, and the cursor of the next page (None on the last)."""

    rows: list[Row]
    next: Cursor | None


def keyset_page(
    fetch: Callable[[Cursor | None, int], Sequence[Row]],
    cursor_of: Callable[[Row], Cursor],
    after: Cursor | None,
    limit: int,
    keep: Callable[[Row], bool] | None = None,
) -> Page[Row, Cursor]:
    """Up to `limit` rows past `after` that `keep` (all when None).

    `fetch(after, n)` answers the first `n` rows past `after` in the listing's order, in one query.
    Unfiltered, a page is one query; filtered, at most `MAX_SCANS` of `max(limit + 1, SCAN_CHUNK)` rows.
    """
    size = limit + 1 if keep is None else max(limit + 1, SCAN_CHUNK)
    kept: list[Row] = []
    for _ in range(MAX_SCANS):
        chunk = fetch(after, size)
        for row in chunk:
            if keep is None or keep(row):
                if len(kept) == limit:
                    return Page(kept, cursor_of(kept[-1]))
                kept.append(row)
            after = cursor_of(row)
        if len(chunk) < size:
            return Page(kept, None)
    return Page(kept, after)  # read as much as a page may: the next page goes on from the last row read
