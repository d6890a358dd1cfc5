"""Layer groups of a load with per-layer events: which event covers which layers.

A worker passes N interprocess events; the daemon records event *g* once layer group *g* of a
load has landed, and the worker's layer *l* waits on the event of its group. Both sides import
this one rule.

Primitives:

- ``layer_group_size(layer_num, events)``: layers per event, ceil(layer_num / events); event
  *g* covers layers [g * size, (g + 1) * size).
- ``group_of(layer, layer_num, events)``: the event that covers ``layer``.
- ``check_layer_events(events, layer_num)``: ``SPEC_INVALID`` for a count that would leave an
  event never recorded, naming the counts that fit.
"""

from __future__ import annotations

from hicache.errors import SpecInvalid


def layer_group_size(layer_num: int, events: int) -> int:
    return -(-layer_num // events)


def group_of(layer: int, layer_num: int, events: int) -> int:
    return layer // layer_group_size(layer_num, events)


def check_layer_events(events: int, layer_num: int) -> None:
    """Every event must cover a layer group: groups of ceil(layer_num / events) layers."""
    if not events:
        return
    if events > layer_num or -(-layer_num // layer_group_size(layer_num, events)) != events:
        fits = sorted({-(-layer_num // g) for g in range(1, layer_num + 1)})
        raise SpecInvalid(f"{events} layer events cannot each cover a group of the pool's "
                          f"{layer_num} layers (groups of ceil(layers / events)); use one of "
                          f"{fits}", metadata={"layer_events": events, "layers": layer_num})
