"""The glossary's names are real: every field, metric and reason code docs/glossary.md names
exists on the wire (the proto), in the daemon's metrics (docs/operations.md's table, itself
checked against the daemon) or in the error table; and the words keep their places: a pool's
"busy" pages and its "pinned" bytes are different fields."""

from __future__ import annotations

import re

from hicache import errors
from hicache.v1 import hicache_pb2 as pb
from tests.daemon_proc import REPO

GLOSSARY = (REPO / "docs" / "glossary.md").read_text()
OPERATIONS = (REPO / "docs" / "operations.md").read_text()
API = (REPO / "docs" / "api.md").read_text()
PROTO = (REPO / "protos" / "hicache" / "v1" / "hicache.proto").read_text()
REASONS = {c.reason for c in vars(errors).values()
           if isinstance(c, type) and issubclass(c, errors.HiCacheError)}


def named() -> set[str]:
    return set(re.findall(r"`([A-Za-z_.\[\]]+)`", GLOSSARY))


def exists(name: str) -> bool:
    if name.startswith("hicache_"):  # a metric: in the metrics table
        return f"`{name}`" in OPERATIONS
    if re.fullmatch(r"[A-Z][A-Z_]+", name):  # a reason code
        return name in REASONS
    if re.fullmatch(r"[A-Z]\w+\.\w+", name):  # a message's field or an enum's value
        message, field = name.split(".")
        d = getattr(pb, message).DESCRIPTOR
        if hasattr(d, "values_by_name"):  # PoolKind.OPAQUE is POOL_KIND_OPAQUE on the wire
            return any(v.endswith(f"_{field}") for v in d.values_by_name)
        return field in d.fields_by_name
    if re.fullmatch(r"[A-Z]\w+", name):  # an RPC
        return name in pb.DESCRIPTOR.services_by_name["HostCache"].methods_by_name
    # a field, setting, config table or name of the docs
    return name in PROTO or name in OPERATIONS or name in API


def test_every_name_the_glossary_gives_exists() -> None:
    names = named()
    assert {"Pool.busy_pages", "hicache_pool_busy_pages", "PAGE_BUSY", "PIN_FAILED"} <= names
    missing = sorted(n for n in names if not exists(n))
    assert not missing, f"docs/glossary.md names what does not exist: {missing}"


def test_busy_and_pinned_are_apart() -> None:
    fields = pb.Pool.DESCRIPTOR.fields_by_name
    assert "busy_pages" in fields and "pinned_bytes" in fields
    assert "deprecated" in OPERATIONS.split("`hicache_pool_pinned_pages`")[1].split("\n")[0]


DEPRECATED_REMOTE = {"remote_tier", "remote_namespace", "remote_puts", "remote_pending",
                     "hicache_remote_"}
"""The old names of tier 3's fields and metrics, kept (deprecated) beside the cluster ones."""
NOT_THE_TIER = {"allow_remote", "HicachedRemoteTierDown", "hicachedremotetierdown"}
"""Names with "remote" that do not call tier 3 so: the KV event setting for peers on other
hosts, and the alert's name (an alert keeps its name: silences and routes match on it)."""


def test_tier_3_is_called_the_cluster_everywhere() -> None:
    """No module, metric, field or doc line calls tier 3 "remote", but for the deprecated
    names kept beside the cluster ones, said so where they appear."""
    found: list[str] = []
    roots = [REPO / "daemon", REPO / "clients" / "python", REPO / "tools", REPO / "docs",
             REPO / "deploy"]
    files = [f for r in roots for f in r.rglob("*")
             if f.suffix in (".py", ".md", ".yml", ".json", ".toml") and "_pb2" not in f.name]
    files += [REPO / "README.md", REPO / "protos" / "hicache" / "v1" / "hicache.proto"]
    for f in files:
        text = f.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            for word in re.findall(r"\w*remote\w*", line, re.IGNORECASE):
                if word in NOT_THE_TIER:
                    continue
                if word in DEPRECATED_REMOTE or word.startswith("hicache_remote_"):
                    if word.replace("remote", "cluster") in text:
                        continue  # an old name, kept beside its new one
                elif re.search(r"deprecated|before|said", line, re.IGNORECASE):
                    continue  # prose that says what the old names were
                found.append(f"{f.relative_to(REPO)}:{n}: {word}")
    assert not found, "tier 3 is the cluster, not remote:\n" + "\n".join(found)


COPY_HOLDS = re.compile(r"held by a copy|copy holds|a copy's hold|counts\(\)\[.held.\]"
                        r"|held for (?:reading|writing)|read-holds?\b"
                        r"|\b(?:pins|unpins|unpinning)\b[^.]*\b(?:cop(?:y|ies)|host pages)\b",
                        re.IGNORECASE)
"""A copy's page lock called a hold, or a pin (page-locked memory is the only pin)."""


def test_a_copys_page_lock_is_busy_never_a_hold_or_a_pin() -> None:
    roots = [REPO / "daemon", REPO / "clients" / "python", REPO / "tools", REPO / "docs"]
    files = [f for r in roots for f in r.rglob("*")
             if f.suffix in (".py", ".md") and "_pb2" not in f.name]
    found = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1) if COPY_HOLDS.search(line)]
    assert not found, "a page a copy is using is busy:\n" + "\n".join(found)
