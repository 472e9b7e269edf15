"""Key buckets of a weighted channel split: which of 10,000 buckets each release owns, moved minimally.

A caller key hashes to one bucket (`bucket_of`); the release owning that bucket serves it. When the
weights change, a release keeps every bucket it owned while its share is unchanged, gives up buckets
from the end of its ranges when its share shrinks, and a release whose share grows takes the freed
buckets: so a key changes release only when the share of its release changed, and then only as many
keys move as the change needs. Ranges are half-open [start, end) pairs, merged where adjacent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

BASIS_POINTS = 10_000  # buckets: a weight of 1 basis point (0.01 %) is one bucket

Ranges = list[tuple[int, int]]


def bucket_of(model: str, channel: str, key: str) -> int:
    """The bucket of a caller key on one channel: stable across processes, versions and hosts."""
    digest = hashlib.sha256(f"{model}\n{channel}\n{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BASIS_POINTS


def size(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(end - start for start, end in ranges)


def merged(ranges: Sequence[Sequence[int]]) -> Ranges:
    """`ranges` sorted, with adjacent ones joined."""
    return _merge([(int(r[0]), int(r[1])) for r in ranges])


def _merge(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


def _trim(ranges: Ranges, keep: int) -> tuple[Ranges, Ranges]:
    """(the first `keep` buckets of `ranges`, the rest)."""
    kept: Ranges = []
    freed: Ranges = []
    for start, end in sorted(ranges):
        take = min(max(keep - size(kept), 0), end - start)
        if take:
            kept.append((start, start + take))
        if start + take < end:
            freed.append((start + take, end))
    return kept, freed


def reassign(previous: Mapping[str, Ranges], weights: Mapping[str, int]) -> dict[str, Ranges]:
    """Buckets for `weights` (member -> basis points, summing to BASIS_POINTS), moving as few as possible
    from `previous` (member -> its ranges; together they cover every bucket once)."""
    if sum(weights.values()) != BASIS_POINTS or any(w <= 0 for w in weights.values()):
        raise ValueError(f"weights must be positive and sum to {BASIS_POINTS}: {dict(weights)}")
    owned: dict[str, Ranges] = {}
    free: Ranges = []
    for member, ranges in previous.items():
        if member in weights:
            owned[member], freed = _trim(list(ranges), weights[member])
            free += freed
        else:
            free += list(ranges)
    covered = size(free) + sum(size(r) for r in owned.values())
    if covered != BASIS_POINTS:  # a malformed previous assignment: start over, in the members' order
        owned, free = {}, [(0, BASIS_POINTS)]
    free = _merge(free)
    for member, weight in weights.items():
        ranges = owned.get(member, [])
        need = weight - size(ranges)
        while need > 0:
            start, end = free.pop(0)
            take = min(need, end - start)
            ranges.append((start, start + take))
            if start + take < end:
                free.insert(0, (start + take, end))
            need -= take
        owned[member] = _merge(ranges)
    return owned


def owner(assignment: Sequence[tuple[object, Sequence[tuple[int, int]]]], bucket: int) -> object:
    """The member whose ranges hold `bucket`."""
    for member, ranges in assignment:
        for start, end in ranges:
            if start <= bucket < end:
                return member
    raise ValueError(f"bucket {bucket} is not assigned")
