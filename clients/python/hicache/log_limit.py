"""Log lines rate-limited per reason, so that a flood of bad calls or a failing tier cannot
fill the disk or take a core formatting the same message.

Primitives: ``LimitedLog(logger, interval)``: ``log(level, msg, *args, key=...)`` (and
``info`` / ``warning`` / ``error``) writes the first line of each ``key`` at once and then at
most one per ``interval`` seconds; a line written after some were held back says how many
("N similar line(s) suppressed in the last S s"). ``suppressed(key)``: held back so far and
not yet said. A key whose last line is older than ``interval`` and has none held back is
forgotten once more than ``KEEP`` keys are kept (its next line is written at once, as it would
be anyway), so keys that name pools, peers or errors that come and go stay bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hicache.locks import lock

KEEP = 256
"""Keys kept before those with nothing to say are pruned."""


class LimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self._clock = logger, interval, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = lock("log_limit")

    def log(self, level: int, msg: str, *args: object, key: str,
            exc_info: BaseException | None = None) -> bool:
        """Write the line unless ``key`` had one within ``interval``; True when written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            if last is None and len(self._last) >= KEEP:
                self._prune(now)
            self._last[key] = now
        if held:
            span = now - (last if last is not None else now)
            msg = f"{msg} ({held} similar line(s) suppressed in the last {span:.0f} s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def _prune(self, now: float) -> None:
        """Forget the keys whose last line is over ``interval`` old with none held back
        (lock held)."""
        for k in [k for k, t in self._last.items()
                  if now - t >= self.interval and k not in self._held]:
            del self._last[k]

    @property
    def kept(self) -> int:
        """Keys kept now."""
        with self._lock:
            return len(self._last)

    def info(self, msg: str, *args: object, key: str) -> bool:
        return self.log(logging.INFO, msg, *args, key=key)

    def warning(self, msg: str, *args: object, key: str) -> bool:
        return self.log(logging.WARNING, msg, *args, key=key)

    def error(self, msg: str, *args: object, key: str,
              exc_info: BaseException | None = None) -> bool:
        return self.log(logging.ERROR, msg, *args, key=key, exc_info=exc_info)

    def suppressed(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)
