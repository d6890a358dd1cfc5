"""The invariants of a ``PageAllocator``, checked after every operation by the tests.

Primitives: ``check_invariants(allocator)`` (the caller holds its lock): the free stack holds
each free page once and nothing else; held pages have one writer or readers, never both; free
pages keep no kind, owner or holder; keyed pages have no owner; the releasing count is right.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hicached.core.allocator import FREE, KEYED
from hicached.core.page_access import RELEASING

if TYPE_CHECKING:
    from hicached.core.allocator import PageAllocator


def check_invariants(a: PageAllocator) -> None:
    """Raise AssertionError when any invariant is broken."""
    n = a.page_num
    stack = a._stack[:a._nfree]
    assert stack.size == np.unique(stack).size, "a page is on the free stack twice"
    assert np.all((stack >= 0) & (stack < n)), "free stack holds a bad page id"
    assert np.all(a._state[stack] == FREE), "a free-stack page is not in FREE state"
    free = a._state == FREE
    assert int(free.sum()) == stack.size, "a FREE page is not on the stack"
    assert np.all(a._readers >= 0), "negative reader count"
    assert not np.any(a._writer & (a._readers > 0)), "a page read while written"
    assert np.all(a._readers[free] == 0) and not a._writer[free].any(), \
        "a free page is held"
    assert np.all(a._kind[free] == 0) and np.all(a._owner[free] == 0), \
        "a free page keeps its kind or owner"
    assert np.all(a._kind[~free] > 0), "a live page has no kind"
    assert np.all(a._owner[a._kind == KEYED] == 0), "a keyed page has an owner"
    releasing = a._state == RELEASING
    assert np.all((a._readers[releasing] > 0) | a._writer[releasing]), \
        "a releasing page is not held"
    assert int(releasing.sum()) == a._releasing, "releasing count is off"
