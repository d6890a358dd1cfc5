"""The engine table (``hicache.engines``): which releases are served, and the refusal of any
other, naming the installed version and what is served, bounded in size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache import engines
from hicache.errors import SpecInvalid

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, line", [
    ("0.33.0", "0.33"), ("0.33.7", "0.33"), ("0.34.0", "0.34"), ("0.34.0rc1", "0.34"),
    ("0.34.1.dev12+g0123abc", "0.34"), ("v0.34.2", "0.34")])
def test_every_release_of_a_vllm_line_served_is_served(version: str, line: str) -> None:
    assert engines.served("vllm", version).line == line


@pytest.mark.parametrize("version", ["0.32.9", "0.35.0", "0.35.0rc1", "1.0", "0.3", "0", "",
                                     "dev", "0.330.0"])
def test_any_other_vllm_is_refused_naming_its_version_and_what_is_served(version: str) -> None:
    with pytest.raises(SpecInvalid) as got:
        engines.served("vllm", version)
    e = got.value
    assert e.reason == "SPEC_INVALID"
    assert e.metadata["engine"] == "vllm"
    assert e.metadata["installed"] == (version or "(no version)")
    assert e.metadata["supported"] == "0.33.x, 0.34.x"
    assert f"vLLM {version or '(no version)'} is not served" in str(e)
    assert "0.33.x, 0.34.x" in str(e)


@pytest.mark.parametrize("version, ok", [("0.5.23", True), ("0.5.23.post1", True),
                                         ("0.5.22", False), ("0.5.24", False),
                                         ("0.5.230", False)])
def test_sglang_is_served_at_its_one_release(version: str, ok: bool) -> None:
    if ok:
        assert engines.served("sglang", version).tested == "0.5.23"
    else:
        with pytest.raises(SpecInvalid, match=r"it serves SGLang 0\.5\.23 "):
            engines.served("sglang", version)


def test_a_huge_or_hostile_version_string_gets_a_bounded_error() -> None:
    with pytest.raises(SpecInvalid) as got:
        engines.served("vllm", "9" * 100_000 + "\x00\n")
    assert len(str(got.value)) < 600 and len(got.value.metadata["installed"]) <= 64


def test_each_tested_release_belongs_to_its_line_and_lines_are_ordered() -> None:
    for engine in ("vllm", "sglang"):
        lines = engines.lines(engine)
        assert lines, engine
        assert [engines.release(x.line) for x in lines] == sorted(
            engines.release(x.line) for x in lines)
        for x in lines:
            assert engines.served(engine, x.tested) == x
    with pytest.raises(ValueError):
        engines.Line("vllm", "0.34", "0.33.0")


def test_the_installed_engines_of_the_test_environment_are_served() -> None:
    """The SGLang the suite installs into its environment is served (vLLM's code lives apart,
    in .vllm-<release>/, and is checked in its own engine processes)."""
    assert engines.check("sglang").tested == engines.installed("sglang")
    assert engines.installed("no_such_engine_installed") == ""
    with pytest.raises(ModuleNotFoundError):  # as importing it would
        engines.check("no_such_engine_installed")


def test_the_readme_names_the_lines_the_table_serves() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("## Supported engines", 1)[1].split("\n## ", 1)[0]
    for engine, name in engines.NAMES.items():
        for x in engines.lines(engine):
            assert re.search(rf"{name} {re.escape(x.label)}", section), (name, x.label)
            assert x.tested in section, x.tested
