"""Descriptor ids by hand, and merging of contiguous descriptor pairs."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink.plan.descriptors import (
    count_merged,
    desc_ids_attention,
    desc_ids_hybrid,
    locate,
    page_descs,
)


def test_attention_ids_are_region_major() -> None:
    ids = desc_ids_attention([3, 7], num_regions=3, blocks_per_region=1000)
    assert ids.tolist() == [3, 7, 1003, 1007, 2003, 2007]


def test_attention_ids_use_each_sides_block_count() -> None:
    assert desc_ids_attention([5], num_regions=2, blocks_per_region=800).tolist() == [5, 805]


def test_hybrid_ids_put_ssm_after_all_attention() -> None:
    ids = desc_ids_hybrid(fa_kernel_ids=[8, 9, 10, 11], ssm_logical_ids=[5], num_fa_regions=2,
                          num_ssm_regions=8, kernel_blocks_per_region=1000, logical_blocks=250)
    assert ids[:8].tolist() == [8, 9, 10, 11, 1008, 1009, 1010, 1011]
    assert ids[8:].tolist() == [2005, 2255, 2505, 2755, 3005, 3255, 3505, 3755]


def test_page_descs_are_page_major() -> None:
    descs = page_descs(base=1000, page_stride=100, num_pages=2, offsets=[0, 40], lengths=[40, 60], device_id=3)
    assert descs.tolist() == [[1000, 40, 3], [1040, 60, 3], [1100, 40, 3], [1140, 60, 3]]


def _descs(rows: list[tuple[int, int]], device: int = 0) -> np.ndarray:
    return np.array([(a, n, device) for a, n in rows], dtype=np.uint64)


def _one_region(descs: np.ndarray) -> np.ndarray:
    return np.zeros(len(descs), dtype=np.int64)


def _merged(local: np.ndarray, remote: np.ndarray) -> int:
    return count_merged(local, remote, _one_region(local), _one_region(remote))


def test_count_merged_joins_only_runs_contiguous_on_both_sides() -> None:
    local = _descs([(0, 16), (16, 16), (32, 16), (100, 16)])
    remote = _descs([(500, 16), (516, 16), (900, 16), (916, 16)])
    # pair 0-1 contiguous on both; 1-2 only locally; 2-3 only remotely
    assert _merged(local, remote) == 3


def test_count_merged_needs_same_device_and_order() -> None:
    local = np.array([(0, 16, 0), (16, 16, 1)], dtype=np.uint64)
    remote = _descs([(0, 16), (16, 16)])
    assert _merged(local, remote) == 2
    assert _merged(_descs([(16, 16), (0, 16)]), _descs([(16, 16), (0, 16)])) == 2
    assert _merged(_descs([]).reshape(0, 3), _descs([]).reshape(0, 3)) == 0


def test_count_merged_never_joins_across_registered_regions() -> None:
    # two regions registered separately, back to back in memory: NIXL keeps them apart
    local, remote = _descs([(0, 16), (16, 16)]), _descs([(500, 16), (516, 16)])
    split = np.array([0, 1], dtype=np.int64)
    assert count_merged(local, remote, split, _one_region(remote)) == 2
    assert count_merged(local, remote, _one_region(local), split) == 2
    assert count_merged(local, remote, _one_region(local), _one_region(remote)) == 1


def test_locate_names_region_and_offset_whatever_the_base_order() -> None:
    region, offset = locate(_descs([(1010, 8), (2000, 8), (1999, 1)]), [2000, 1000])
    assert region.tolist() == [1, 0, 1] and offset.tolist() == [10, 0, 999]


def test_count_merged_refuses_unpaired_arrays() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        count_merged(_descs([(0, 1)]), _descs([(0, 1), (1, 1)]), _one_region(_descs([(0, 1)])),
                     _one_region(_descs([(0, 1), (1, 1)])))
    with pytest.raises(ValueError, match="one region index per descriptor"):
        count_merged(_descs([(0, 1)]), _descs([(0, 1)]), _one_region(_descs([])), _one_region(_descs([])))
