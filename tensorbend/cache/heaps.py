"""Heaps with lazy invalidation, as the victim indexes keep them: entries (..., key), some stale.

Usage:
    >>> import heapq
    >>> heap = [(1, "a"), (2, "b"), (3, "c")]
    >>> heapq.heapify(heap)
    >>> first_live(heap, lambda item: item[1] == "a", lambda key: key != "b")  # a stale, b pinned
    (3, 'c')
    >>> heap                               # the stale entry went, the pinned one is back
    [(2, 'b'), (3, 'c')]

`first_live` is the walk every index makes for its candidate: stale entries (the key left, or
was re-ranked since) are popped for good, entries of keys that are not evictable right now
(loading or pinned) are set aside and pushed back. `compact` drops every stale entry of a heap
that grew too long.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from tensorbend.cache.resident import Evictable


def first_live(heap: list, stale: Callable[[tuple], bool], evictable: Evictable) -> tuple | None:
    """The first entry, in heap order, that is not `stale` and whose key (its last field) is
    evictable; the entries before it that are stale go, the others stay."""
    aside, found = [], None
    while heap:
        item = heap[0]
        if stale(item):
            heapq.heappop(heap)
        elif evictable is None or evictable(item[-1]):
            found = item
            break
        else:
            aside.append(heapq.heappop(heap))
    for entry in aside:
        heapq.heappush(heap, entry)
    return found


def compact(heap: list, version: dict) -> None:
    """Drop stale entries of a heap of (..., version, key): a version no longer the key's."""
    heap[:] = [item for item in heap if version[item[-1]] == item[-2]]
    heapq.heapify(heap)
