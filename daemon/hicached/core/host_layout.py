"""Where the bytes of a pool component live in host memory, for each layout.

Primitives:

- ``host_shape(comp, layout, layer_num, size_tokens, page_size)``: SGLang's host buffer shape of
  one component (without the leading 2 of MHA K/V).
- ``HostAddressing``: byte offsets of unit rows (layer, page, unit) in such a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.specs import Component, Layout


def host_shape(comp: Component, layout: Layout, layer_num: int, size_tokens: int,
               page_size: int) -> tuple[int, ...]:
    """SGLang's host buffer shape of one component (without the leading 2 of MHA K/V)."""
    page_num = size_tokens // page_size
    if comp.page_granular:
        if layout is Layout.LAYER_FIRST:
            return (layer_num, page_num, *comp.unit_shape)
        return (page_num, layer_num, 1, *comp.unit_shape)
    if layout is Layout.LAYER_FIRST:
        return (layer_num, size_tokens, *comp.unit_shape)
    if layout is Layout.PAGE_FIRST:
        return (size_tokens, layer_num, *comp.unit_shape)
    return (page_num, layer_num, page_size, *comp.unit_shape)


@dataclass(frozen=True)
class HostAddressing:
    """Byte offsets of unit rows in a host component buffer.

    Row (layer ``l``, page ``p``, unit ``u``) starts at
    ``l * layer_stride + p * page_pitch + u * unit_stride``.
    """

    layer_stride: int
    page_pitch: int
    unit_stride: int

    @staticmethod
    def of(comp: Component, layout: Layout, layer_num: int, size_tokens: int,
           page_size: int) -> HostAddressing:
        ub = comp.unit_bytes
        upp = comp.units_per_page(page_size)
        units_total = size_tokens // page_size * upp
        if layout is Layout.LAYER_FIRST:
            return HostAddressing(units_total * ub, upp * ub, ub)
        if layout is Layout.PAGE_FIRST and not comp.page_granular:
            return HostAddressing(ub, upp * layer_num * ub, layer_num * ub)
        return HostAddressing(upp * ub, layer_num * upp * ub, ub)
