"""D's digest slots hand back each landed slice as one row, padded with zeros to the widest
group's slice, whatever mix of groups and slots a load's READ used."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.connector.digest_table import DigestSlots
from kvlink.layout.digests import DigestLayout


class _Agent:
    """Registration only: the slots' memory never leaves this process here."""

    def register_regions(self, regions: Any) -> None:
        self.regions = list(regions)


@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.integers(0, 9), min_size=1, max_size=4), slots=st.integers(1, 6), data=st.data())
def test_slices_are_the_rows_entries_padded(units: list[int], slots: int, data: st.DataObject) -> None:
    offsets, at = [], 0
    for n in units:
        offsets.append(at)
        at += 1 + n
    layout = DigestLayout(8, tuple(offsets), tuple(units))
    pool = DigestSlots(layout, slots, _Agent(), 0)  # type: ignore[arg-type]
    pool.rows[:] = np.arange(pool.rows.size, dtype=np.uint64).reshape(pool.rows.shape) + 1
    count = data.draw(st.integers(0, 8), "slices")
    groups = np.array(data.draw(st.lists(st.integers(0, len(units) - 1), min_size=count, max_size=count)),
                      dtype=np.int64)
    rows = data.draw(st.lists(st.integers(0, slots - 1), min_size=count, max_size=count))
    got = pool.slices(groups, rows)
    width = 1 + max(units)
    assert got.shape == (count, width) and got.dtype == np.uint64
    for i, (group, row) in enumerate(zip(groups.tolist(), rows, strict=True)):
        n = 1 + units[group]
        assert got[i, :n].tolist() == pool.rows[row, offsets[group]:offsets[group] + n].tolist()
        assert not got[i, n:].any()
