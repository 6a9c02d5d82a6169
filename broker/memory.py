"""Handing freed heap back to the system.

After a burst (a flood of requests, queues of unread replies dropped with their connections) the memory
is free again inside the process, but glibc's allocator keeps most of it mapped, so the broker's RSS stays
up by tens of MB. `trim_heap` asks glibc to return what it can (`malloc_trim(0)`); the broker calls it at
idle moments after a full collection. A no-op where the C library has no malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn  # type: ignore[no-any-return]


def trim_heap() -> bool:
    """Return free heap memory to the system; True if the C library did release some."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
