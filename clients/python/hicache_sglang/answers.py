"""What the daemon answered each request's lookup: the linker's book of promises.

SGLang asks ``lookup(rid, ...)`` when it matches a request, then ``load(rid, ...)`` once it
admits it; between the two the daemon holds the hit's pages for the linker's session
(``lookup_hold_ms``). SGLang matches a request it cannot admit yet again on every loop of its
scheduler: while an answer is fresh, the same request asking for the same keys is told that
answer again instead of asking the daemon (whose holds it would only renew). Freshness, and
the claims on the holds, are the linker's ``hicache_client.hold_book`` (the vLLM manager's
rules too).

Primitives:

- ``Answer(keys, hit, at, session)``: a lookup's keys, how many leading ones the daemon
  holds for the session, when, and the session (holds end with their session: an answer
  from before a re-open promises nothing).
- ``Answers(book)``: ``reuse(rid, keys, session)`` (the fresh answer to the same
  question on this session, or None), ``record(rid, keys, hit, session)`` (returns the
  requests whose answers it forgot: at most ``MAX_ANSWERS`` are kept, the oldest forgotten
  first), ``take(rid)`` (the answer a load
  counts on, forgotten), ``covers(answer, keys, session)`` (its holds surely still cover
  ``keys``),
  ``clear()``. Used on the scheduler's thread only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_client.hold_book import HoldBook

MAX_ANSWERS = 4096


@dataclass(frozen=True)
class Answer:
    keys: tuple[Any, ...]
    hit: int
    """The leading keys the daemon holds for the linker's session."""
    at: float
    """``time.monotonic()`` of the lookup."""
    session: object = None
    """The session it was asked on (its holds are that session's)."""


class Answers:
    def __init__(self, book: HoldBook) -> None:
        self.holds = book
        """Whose rule says how long an answer is trusted (never without holds)."""
        self._book: collections.OrderedDict[str, Answer] = collections.OrderedDict()

    def fresh(self, answer: Answer) -> bool:
        """Whether ``answer``'s holds are sure to stand still."""
        return self.holds.fresh(answer.at)

    def reuse(self, rid: str, keys: tuple[Any, ...], session: object) -> Answer | None:
        """The answer ``rid`` got for these very keys on ``session``, while it is fresh."""
        known = self._book.get(rid)
        if (known is not None and known.keys == keys and known.session is session
                and self.fresh(known)):
            return known
        return None

    def record(self, rid: str, keys: tuple[Any, ...], hit: int, session: object) -> list[str]:
        self._book[rid] = Answer(keys, hit, time.monotonic(), session)
        self._book.move_to_end(rid)
        forgotten = []
        while len(self._book) > MAX_ANSWERS:
            forgotten.append(self._book.popitem(last=False)[0])
        return forgotten

    def take(self, rid: str) -> Answer | None:
        return self._book.pop(rid, None)

    def covers(self, answer: Answer | None, keys: Sequence[Any], session: object) -> bool:
        """Whether ``answer``'s holds surely still cover ``keys`` (a prefix of its hit, asked
        on ``session``)."""
        return (answer is not None and len(keys) <= answer.hit
                and tuple(keys) == answer.keys[:len(keys)]
                and answer.session is session and self.fresh(answer))

    def clear(self) -> None:
        self._book.clear()
