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
withheld it costs one attribute read per free.

Primitives: ``SlotQuarantine(allocator, page_size)``: ``withhold(token_indices,
session_id)``, ``release(session_id)`` (that session's pages freed meanwhile go back, those
another session still withholds stay; no id: every session's), ``withheld`` (pages withheld
now), ``kept`` (pages SGLang freed and the quarantine still keeps), ``sessions`` (sessions
withholding), ``close()``; ``installed`` is False when the allocator has no such hook (then a
timed-out load's slots go back at once, as SGLang does without this, and the linker logs it
once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger("hicache_sglang")


class SlotQuarantine:
    def __init__(self, allocator: Any, page_size: int) -> None:
        self._allocator = allocator
        self._page_size = page_size
        self._lock = threading.Lock()
        self._by_session: dict[str, torch.Tensor] = {}
        """Page ids each session withholds (on the allocator's device)."""
        self._withheld: torch.Tensor | None = None
        """Every session's together, or None: read without the lock on each free."""
        self._kept: list[torch.Tensor] = []
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
        its pages goes back, but for pages another session still withholds; returns how
        many pages went back."""
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
        self._release_pages(kept)
        return int(kept.numel())

    def close(self) -> None:
        self.release()
        if self.installed:
            self._allocator._release_page_ids = self._release_pages
