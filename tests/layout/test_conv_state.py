"""SSM conv state between layouts: the planning view and the in-place re-layout."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvlink.layout.conv_state import (
    conv_layouts,
    conv_transpose,
    planning_view,
    same_but_conv_layouts,
    transpose_in_place,
    with_conv_layouts,
)
from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs
from kvlink.layout.presets import TINY_HYBRID
from kvlink.plan.compat import IncompatibleLayout, check_compatible

SD = with_conv_layouts(TINY_HYBRID, {1: "SD"})


def _geometry(model, tp=2, rank=1):  # type: ignore[no-untyped-def]
    return build_worker_geometry(model, tp, rank, 16, 16, 6, packed_base_addrs(model, tp, 16, 16, 6, 1 << 20))


def test_the_layouts_are_the_only_difference() -> None:
    assert conv_layouts(TINY_HYBRID) == {1: "DS"} and conv_layouts(SD) == {1: "SD"}
    assert SD.compat_hash() != TINY_HYBRID.compat_hash()
    assert same_but_conv_layouts(TINY_HYBRID, SD) and same_but_conv_layouts(SD, SD)
    assert not same_but_conv_layouts(TINY_HYBRID, replace(SD, name="other"))
    bigger = with_conv_layouts(replace(TINY_HYBRID, groups=(TINY_HYBRID.groups[0], replace(
        TINY_HYBRID.groups[1], d_state=TINY_HYBRID.groups[1].d_state * 2))), {1: "SD"})  # type: ignore[union-attr]
    assert not same_but_conv_layouts(TINY_HYBRID, bigger)


def test_planning_view_is_the_same_memory_in_the_sources_layout() -> None:
    d = _geometry(SD)
    view = planning_view(d, TINY_HYBRID)
    assert view.model == TINY_HYBRID and planning_view(d, SD) is d
    assert [(r.base, r.page_len, r.page_stride, r.num_pages) for r in view.regions] == \
        [(r.base, r.page_len, r.page_stride, r.num_pages) for r in d.regions]
    # the temporal state sits where it did: only the conv parts are cut differently
    assert [s.offset for s in view.ssm_regions[0].sub_parts][-1] == [s.offset for s in d.ssm_regions[0].sub_parts][-1]
    with pytest.raises(IncompatibleLayout, match="SSM conv state layout: P has 'DS', D has 'SD'"):
        check_compatible(_geometry(TINY_HYBRID), d)  # raw geometries: a plain copy would scramble it
    check_compatible(_geometry(TINY_HYBRID), view)
    other = replace(TINY_HYBRID, name="other")
    assert planning_view(d, other) is d


@pytest.mark.parametrize("arrived", ["DS", "SD"])
@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
def test_transpose_in_place(arrived: str, elem_bytes: int) -> None:
    channels, rows = 6, 3
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[elem_bytes]
    state = np.arange(channels * rows, dtype=dtype).reshape(channels, rows)  # [channel, row]
    data = np.ascontiguousarray(state if arrived == "DS" else state.T).view(np.uint8).reshape(-1).copy()
    transpose_in_place(data, channels, rows, elem_bytes, arrived)  # type: ignore[arg-type]
    want = state.T if arrived == "DS" else state
    np.testing.assert_array_equal(data.view(dtype).reshape(want.shape), want)


def test_conv_transpose_touches_only_the_conv_state_of_the_blocks_given() -> None:
    d = _geometry(SD, tp=1, rank=0)
    start = d.regions[0].base
    size = max(r.end for r in d.regions) - start
    memory = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    before = memory.copy()
    transpose = conv_transpose(d, planning_view(d, TINY_HYBRID))
    assert transpose is not None and transpose.groups == (1,) and dict(transpose.arrived) == {1: "DS"}
    assert conv_transpose(d, d) is None
    moved = transpose.apply({1: [4]}, lambda a, n: memory[a - start: a - start + n])
    (region, *_) = transpose.regions
    assert moved == region.nbytes * len(d.ssm_regions)
    changed = np.flatnonzero(memory != before) + start
    for r in d.ssm_regions:  # inside each layer's page 4, inside its conv state
        inside = (changed >= r.base + 4 * r.page_stride) & (changed < r.base + 4 * r.page_stride + region.nbytes)
        changed = changed[~inside]
    assert not changed.size
    with pytest.raises(ValueError, match="outside"):
        transpose.apply({1: [6]}, lambda a, n: memory[a - start: a - start + n])
