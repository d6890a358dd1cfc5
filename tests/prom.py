"""Reading a Prometheus page in tests with prometheus_client's own parser.

- ``samples(text, name)``: every sample named ``name`` (a counter's ``_total`` included), as
  (labels, value).
- ``value(text, name, **labels)``: the sum of the samples of ``name`` whose labels include
  ``labels``; ``AssertionError`` when none does and no ``default`` is given.
- ``names(text)``: the name of every sample on the page.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

_NONE = object()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, default: float | object = _NONE, **labels: str) -> float:
    got = [v for lab, v in samples(text, name)
           if all(lab.get(k) == want for k, want in labels.items())]
    if not got:
        if default is _NONE:
            raise AssertionError(f"no sample {name}{labels or ''} on the page")
        return float(default)  # type: ignore[arg-type]
    return sum(got)
