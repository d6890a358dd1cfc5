"""Importing this module checks that the installed vLLM is one hicached serves.

``hicache_vllm.spec`` and ``hicache_vllm.connector`` import it before any module of vLLM, so
a vLLM outside ``hicache.engines``' table stops where vLLM loads the spec or the connector,
at its start-up, with ``SPEC_INVALID`` naming the installed version and the lines served,
before an import of something that release lacks could fail with another error.

Primitives: ``LINE``: the ``hicache.engines.Line`` the installed vLLM belongs to.
"""

from __future__ import annotations

from hicache import engines

LINE = engines.check("vllm")
