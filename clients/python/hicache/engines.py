"""The inference engines hicached serves, in one table, and the check each integration makes
when its engine starts it.

The engines move monthly and their offloading APIs with them, so what hicached serves is a
list of release lines, each with the release the test suite runs. An engine outside the table
stops at start-up with ``SPEC_INVALID`` naming its installed version and what is served,
never meets an ``AttributeError`` while serving. README.md ("Supported engines") says the
same; tests/repo holds it to this table.

A version belongs to a line when its release numbers begin with the line's: vLLM 0.34.2,
0.34.0rc1 and 0.34.1.dev3+g0123abc are of line 0.34; SGLang 0.5.23.post1 of line 0.5.23.

Primitives:

- ``Line(engine, line, tested)``: one release line and the release the suite tests.
- ``LINES``: every line served, oldest first per engine; ``lines(engine)``.
- ``release(version)``: a version's leading release numbers, ``(0, 34, 1)``.
- ``served(engine, version)``: the ``Line`` the version belongs to, or ``SpecInvalid``
  (metadata: ``engine``, ``installed``, ``supported``).
- ``installed(engine)``: the engine's version as its distribution's metadata says (""
  when it has none).
- ``check(engine)``: ``served(engine, installed(engine))`` (``ModuleNotFoundError`` where the
  engine is not installed at all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hicache.errors import SpecInvalid

_RELEASE = re.compile(r"\s*v?(\d{1,9}(?:\.\d{1,9})*)")


def release(version: str) -> tuple[int, ...]:
    """The leading release numbers of ``version`` (``()`` when it has none; read from its
    first 64 characters, each number of at most 9 digits)."""
    m = _RELEASE.match(version[:64])
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


@dataclass(frozen=True)
class Line:
    engine: str
    """The engine's distribution name (``vllm``, ``sglang``)."""
    line: str
    """The release line: every release whose numbers begin with these (``0.34``)."""
    tested: str
    """The release of the line the test suite runs (``0.34.0``)."""

    def __post_init__(self) -> None:
        if release(self.tested)[:len(release(self.line))] != release(self.line):
            raise ValueError(f"{self.engine} {self.tested} is not of line {self.line}")

    @property
    def label(self) -> str:
        """How the line is written to users: ``0.34.x``, or the release itself."""
        return f"{self.line}.x" if len(release(self.line)) < 3 else self.line


LINES: tuple[Line, ...] = (
    Line("vllm", "0.33", "0.33.0"),
    Line("vllm", "0.34", "0.34.0"),
    Line("sglang", "0.5.23", "0.5.23"),
)
"""Every release line hicached serves."""

NAMES = {"vllm": "vLLM", "sglang": "SGLang"}

def lines(engine: str) -> tuple[Line, ...]:
    return tuple(x for x in LINES if x.engine == engine)


def served(engine: str, version: str) -> Line:
    """The line ``version`` of ``engine`` belongs to; ``SpecInvalid`` when none does."""
    have = release(version)
    for x in lines(engine):
        want = release(x.line)
        if have[:len(want)] == want:
            return x
    name = NAMES.get(engine, engine)
    supported = ", ".join(x.label for x in lines(engine)) or "none"
    shown = version[:64] or "(no version)"
    raise SpecInvalid(f"{name} {shown} is not served by this hicached: it serves {name} "
                      f"{supported} (README.md, \"Supported engines\"); install one of those, "
                      f"or a hicached that serves {name} {shown}",
                      metadata={"engine": engine, "installed": shown, "supported": supported})


def installed(engine: str) -> str:
    """``engine``'s version from its distribution's metadata ("" when not installed)."""
    from importlib import metadata

    try:
        return metadata.version(engine)
    except metadata.PackageNotFoundError:
        return ""


def check(engine: str) -> Line:
    """The line of the installed ``engine``, or ``SpecInvalid`` naming its version; an engine
    that is not there at all is ``ModuleNotFoundError``, as importing it would be."""
    version = installed(engine)
    if not version:
        import importlib.util

        if importlib.util.find_spec(engine) is None:
            raise ModuleNotFoundError(f"No module named {engine!r}", name=engine)
    return served(engine, version)
