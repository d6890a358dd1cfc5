"""Importing this module checks that the installed SGLang is one hicached serves.

``hicache_sglang.linker`` imports it before any module of SGLang, so an SGLang outside
``hicache.engines``' table stops where SGLang loads the linker (its external linker's dotted
path, at the server's start-up) with ``SPEC_INVALID`` naming the installed version and the
releases served, before an import of something that release lacks could fail otherwise.

Primitives: ``LINE``: the ``hicache.engines.Line`` the installed SGLang belongs to.
"""

from __future__ import annotations

from hicache import engines

LINE = engines.check("sglang")
