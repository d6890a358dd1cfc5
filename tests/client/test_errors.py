from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache import errors
from hicache.errors import HiCacheError, Violation, all_error_classes, raise_violations


def test_reason_codes_are_unique_and_upper_snake() -> None:
    reasons = [c.reason for c in all_error_classes()]
    assert len(reasons) == len(set(reasons))
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]+", r) for r in reasons)


def test_every_reason_is_documented_in_the_api_doc() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    missing = [c.reason for c in all_error_classes() if f"`{c.reason}`" not in doc]
    assert not missing, f"the reason table in docs/api.md lacks {missing}"


def test_hierarchy_docstring_names_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in all_error_classes():
        assert cls.__name__ in doc, cls.__name__


def test_raise_violations_raises_first_and_keeps_all() -> None:
    vs = [Violation("a", "INDEX_OUT_OF_RANGE", "x", {"k": "1"}),
          Violation("b", "DUPLICATE_PAGE", "y")]
    try:
        raise_violations(vs)
    except HiCacheError as exc:
        assert type(exc) is errors.IndexOutOfRange
        assert exc.violations == tuple(vs)
        assert exc.metadata == {"k": "1"}
        assert "INDEX_OUT_OF_RANGE" in str(exc)
    else:
        raise AssertionError("nothing raised")
    raise_violations([])


@pytest.mark.parametrize("said,wait", [("50", 0.05), ("0", 0.001), ("-5", 0.001),
                                       ("1e9", 10.0), ("abc", 0.01), ("nan", 0.01),
                                       ("", 0.01), (None, 0.01), ("2.5", 0.0025)])
def test_a_retry_after_is_read_once_and_bounded(said: str | None, wait: float) -> None:
    """What the daemon (or anything speaking for it) says to wait: honoured within
    [1 ms, 10 s]; malformed or absent, the default, never an exception in a retry loop."""
    from hicache.errors import Overloaded

    exc = Overloaded("busy", metadata={} if said is None else {"retry_after_ms": said})
    assert exc.retry_after() == pytest.approx(wait)
