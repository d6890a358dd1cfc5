"""Device slots of a load that timed out stay out of SGLang's hands until its copy ended.

A load whose call missed its deadline fails, and SGLang aborts its requests and frees their
slots, but the daemon (paused, swapping) may still be copying into them: handed to another
request, those slots would receive stale KV. So before the failure is reported the linker
*withholds* the slots' pages: SGLang's allocator frees them as usual, but they return to its
free list only once the link is fenced (a heartbeat showed no load of the session still
copying: ``hicache_client.link``). The daemon refuses any load whose copy would begin after
its deadline (``DEADLINE_PASSED``), so after the fence nothing more can land.

The hook is the allocator's one place where freed pages return to its free list
(``_release_page_ids`` of SGLang 0.5.23's ``PagedTokenToKVPoolAllocator``): while nothing is
withheld it costs one attribute read per free.

Primitives: ``SlotQuarantine(allocator, page_size)``: ``withhold(token_indices)``,
``release()`` (the pages freed meanwhile go back), ``withheld`` (pages withheld now),
``kept`` (pages SGLang freed and the quarantine still keeps), ``close()``; ``installed`` is
False when the allocator has no such hook (then a timed-out load's slots go back at once,
as SGLang does without this, and the linker logs it once).
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
        self._withheld: torch.Tensor | None = None
        """Page ids withheld (on the allocator's device), or None."""
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

    def withhold(self, token_indices: torch.Tensor) -> None:
        """The pages of ``token_indices`` (a failed load's destination) are kept from the
        free list until ``release``."""
        if not self.installed or not token_indices.numel():
            return
        pages = torch.unique(token_indices.to(torch.int64) // self._page_size)
        with self._lock:
            device = getattr(self._allocator, "device", pages.device)
            pages = pages.to(device)
            self._withheld = (pages if self._withheld is None
                              else torch.unique(torch.cat((self._withheld, pages))))

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
            self._kept.append(ids[held])
            free = ids[~held]
        if free.numel():
            self._release_pages(free)  # type: ignore[misc]

    def release(self) -> int:
        """The copies ended: what SGLang freed meanwhile goes back; returns how many pages."""
        with self._lock:
            kept, self._kept = self._kept, []
            self._withheld = None
        if not kept or self._release_pages is None:
            return 0
        pages = torch.cat(kept)
        if pages.numel():
            self._release_pages(pages)
        return int(pages.numel())

    def close(self) -> None:
        self.release()
        if self.installed:
            self._allocator._release_page_ids = self._release_pages
