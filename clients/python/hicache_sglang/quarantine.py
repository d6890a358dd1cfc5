"""Device slots of a load that timed out stay out of SGLang's hands until its copy ended.

A load whose call missed its deadline fails, and SGLang aborts its requests and frees their
slots, but the daemon (paused, swapping) may still be copying into them: handed to another
request, those slots would receive stale KV. So before the failure is reported the linker
*withholds* the slots' pages, under the session the load ran on: SGLang's allocator frees
them as usual, but they return to its free list only once that session is fenced (no copy of
it can land any more: ``hicache_client.link``, on whichever way the link comes back). The
daemon refuses any load whose copy would begin after its deadline (``DEADLINE_PASSED``), so
after the fence nothing more can land. A page two sessions withhold goes back once both are
fenced.

The hook is the allocator's one place where freed pages return to its free list
(``_release_page_ids`` of SGLang 0.5.23's ``PagedTokenToKVPoolAllocator``): while nothing is
withheld it costs one attribute read per free. SGLang's allocator is the scheduler's alone
(not thread-safe), and a fence comes on the link's thread: ``release`` only marks the pages
due, and they go back on the scheduler's thread, at its next free (the hook) or next call
into the linker (``hand_back``).

Primitives: ``SlotQuarantine(allocator, page_size)``: ``withhold(token_indices,
session_id)``, ``release(session_id)`` (that session's pages freed meanwhile are due back, those
another session still withholds stay; no id: every session's), ``hand_back()`` (the
scheduler's thread: pages due go back to the free list), ``withheld`` (pages withheld now),
``kept`` (pages SGLang freed and the quarantine still keeps), ``due`` (pages released and not
yet handed back), ``sessions`` (sessions withholding), ``close()``; ``installed`` is False
when the allocator has no such hook (then a timed-out load's slots go back at once, as SGLang
does without this, and the linker logs it once).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache.locks import lock

log = logging.getLogger("hicache_sglang")


class SlotQuarantine:
    def __init__(self, allocator: Any, page_size: int) -> None:
        self._allocator = allocator
        self._page_size = page_size
        self._lock = lock("sglang.quarantine")
        self._by_session: dict[str, torch.Tensor] = {}
        """Page ids each session withholds (on the allocator's device)."""
        self._withheld: torch.Tensor | None = None
        """Every session's together, or None: read without the lock on each free."""
        self._kept: list[torch.Tensor] = []
        self._due: list[torch.Tensor] = []
        """Pages whose fence came (on the link's thread), to go back on the scheduler's."""
        self._any_due = False
        """Read without the lock on each free and each linker call: anything due?"""
        self._release_pages = getattr(allocator, "_release_page_ids", None)
        self.installed = callable(self._release_pages)
        if self.installed:
            allocator._release_page_ids = self._filtered
        else:
            log.warning("SGLang's allocator %s has no _release_page_ids: device slots of a "
                        "load that timed out go back to it at once",
                        type(allocator).__name__)

    @property
    def withheld(self) -> int:
        w = self._withheld
        return 0 if w is None else int(w.numel())

    @property
    def kept(self) -> int:
        return sum(int(t.numel()) for t in self._kept)

    @property
    def due(self) -> int:
        with self._lock:
            return sum(int(t.numel()) for t in self._due)

    @property
    def sessions(self) -> int:
        return len(self._by_session)

    def withhold(self, token_indices: torch.Tensor, session_id: str) -> None:
        """The pages of ``token_indices`` (a failed load's destination, on ``session_id``)
        are kept from the free list until that session's ``release``."""
        if not self.installed or not token_indices.numel():
            return
        pages = torch.unique(token_indices.to(torch.int64) // self._page_size)
        with self._lock:
            device = getattr(self._allocator, "device", pages.device)
            pages = pages.to(device)
            had = self._by_session.get(session_id)
            self._by_session[session_id] = (pages if had is None
                                            else torch.unique(torch.cat((had, pages))))
            self._withheld = torch.unique(torch.cat(list(self._by_session.values())))

    def _filtered(self, *page_ids: torch.Tensor) -> None:
        """The allocator's free, on the scheduler's thread."""
        if self._any_due:
            self.hand_back()
        withheld = self._withheld
        if withheld is None:  # the common case: nothing withheld
            assert self._release_pages is not None
            self._release_pages(*page_ids)
            return
        with self._lock:
            withheld = self._withheld
            if withheld is None:
                self._release_pages(*page_ids)  # type: ignore[misc]
                return
            ids = torch.cat([p.to(withheld.device) for p in page_ids])
            held = torch.isin(ids, withheld)
            if bool(held.any()):
                self._kept.append(ids[held])
            free = ids[~held]
        if free.numel():
            self._release_pages(free)  # type: ignore[misc]

    def release(self, session_id: str | None = None) -> int:
        """No copy of ``session_id`` (None: of any) can land any more: what SGLang freed of
        its pages is due back (``hand_back``), but for pages another session still
        withholds; returns how many pages are due. Any thread: the allocator is not
        touched."""
        with self._lock:
            if session_id is None:
                self._by_session.clear()
            else:
                self._by_session.pop(session_id, None)
            rest = (torch.unique(torch.cat(list(self._by_session.values())))
                    if self._by_session else None)
            self._withheld = rest
            kept = torch.cat(self._kept) if self._kept else None
            self._kept = []
            if kept is not None and rest is not None:
                still = torch.isin(kept, rest)
                if bool(still.any()):
                    self._kept.append(kept[still])
                kept = kept[~still]
            if kept is None or self._release_pages is None or not kept.numel():
                return 0
            self._due.append(kept)
            self._any_due = True
        return int(kept.numel())

    def hand_back(self) -> int:
        """On the scheduler's thread: the pages due go back to SGLang's free list; how
        many. One attribute read while none is due."""
        if not self._any_due:
            return 0
        with self._lock:
            due, self._due = self._due, []
            self._any_due = False
        if not due or self._release_pages is None:
            return 0
        pages = torch.cat(due)
        self._release_pages(pages)
        return int(pages.numel())

    def close(self) -> None:
        """On the scheduler's thread (the linker's close): everything goes back."""
        self.release()
        self.hand_back()
        if self.installed:
            self._allocator._release_page_ids = self._release_pages
