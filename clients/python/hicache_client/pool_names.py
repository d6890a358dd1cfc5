"""How an engine integration names its pools: one rule for every engine.

A hicached pool is a key namespace: two workers share pages exactly when their pool names are
equal. Each integration lists what makes its pages' bytes differ (its page format, the model,
its geometry, an operator namespace, ...) and the shard a rank writes; the name is readable
where it can be and exact where it must be: ``<prefix>-<model's last path part>-<12 hex digits
of SHA-256 over every part and the shard>-<shard>``, at most 128 characters. Names persist in
the daemon's state (a restarted engine finds its pool by name), so this rule and each
integration's parts never change for the same inputs: tests pin known names.

Primitives: ``pool_name(prefix, model, parts, shard)``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def pool_name(prefix: str, model: str, parts: Sequence[str], shard: str) -> str:
    """The pool of ``shard``'s pages: equal only when ``prefix``, every part and the shard
    are (``model`` gives the readable part only: list it among ``parts`` too)."""
    digest = hashlib.sha256("\x00".join([*parts, shard]).encode()).hexdigest()[:12]
    base = _UNSAFE.sub("-", model.rstrip("/").rsplit("/", 1)[-1]).strip("-.") or "model"
    return f"{prefix}-{base[:40]}-{digest}-{shard}"[:128]
