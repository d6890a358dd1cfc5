"""Removals made final below host memory: the epochs of the writers a pool's cache lends to.

A writer to a tier below (a spiller, a write-through writer) borrows pages of ready keys and
commits them to its tier later, outside the cache's lock; a key removed meanwhile must not
come back through it. Each removal is numbered and recorded before any tier hears of it; a
writer's *epoch* is the number when it borrowed; before it commits a key it asks
``removed_since(key, epoch)`` under its tier's own lock. Whichever comes second, the removal
or the commit, sees the other. Removals are remembered only while a writer is out, and only
those a writer out now predates.

Primitives: ``RemovalLog`` (``record(keys)`` / ``record(None)`` for a clear, ``seq``,
``lend()`` -> epoch, ``end_lend(epoch)``, ``removed_since(key, epoch)``, ``kept``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class RemovalLog:
    """The removals and lent epochs of one pool's cache. Its owner's lock is held for every
    call but ``removed_since``, which a tier asks lock-free (see the module's docstring)."""

    def __init__(self) -> None:
        self.seq = 0
        """Removals so far (a writer's epoch is the sequence when it borrowed)."""
        self._removed_at: dict[bytes, int] = {}
        """Keys removed while some writer is out, and when."""
        self._cleared_at = -1
        """When the pool was last cleared while a writer was out."""
        self._lent: Counter[int] = Counter()
        """Epochs of the writers out now (how many of each)."""

    @property
    def kept(self) -> int:
        """Removed keys remembered now (the soak watches it stay flat)."""
        return len(self._removed_at)

    @property
    def lent(self) -> int:
        """Writers out now."""
        return sum(self._lent.values())

    def record(self, keys: Sequence[bytes] | None) -> None:
        """A removal of ``keys`` (None: a clear), before it reaches any tier: every writer
        out now will see it."""
        self.seq += 1
        if keys is None:
            self._cleared_at = self.seq
            self._removed_at.clear()
        elif self._lent:
            for k in keys:
                self._removed_at[k] = self.seq

    def removed_since(self, key: bytes, epoch: int) -> bool:
        """Whether ``key`` was removed (or the pool cleared) after ``epoch``."""
        return self._cleared_at > epoch or self._removed_at.get(key, -1) > epoch

    def lend(self) -> int:
        """A writer goes out: its epoch."""
        epoch = self.seq
        self._lent[epoch] += 1
        return epoch

    def end_lend(self, epoch: int) -> None:
        """The writer of ``epoch`` is back: removals no writer out predates are forgotten."""
        self._lent[epoch] -= 1
        if self._lent[epoch] <= 0:
            oldest = min(self._lent)
            del self._lent[epoch]
            if not self._lent:  # no writer out: no commit can predate a removal now
                self._removed_at.clear()
            elif epoch == oldest:  # removals no writer out now predates are asked no more
                first = min(self._lent)
                for k in [k for k, at in self._removed_at.items() if at <= first]:
                    del self._removed_at[k]
