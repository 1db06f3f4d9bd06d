"""The range check takes numpy scalars like Python numbers (engines hand over array values)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink.layout.limits import FRACTION, SEED, TP, check


def test_numpy_integers_pass_an_integer_range() -> None:
    assert check("tp_size", np.int64(4), TP) == 4
    assert check("fraction", np.float32(0.5), FRACTION) == 0.5


@pytest.mark.parametrize("value", [np.float64(4.0), True, np.bool_(True), "4", np.int64(0)])
def test_non_integers_and_out_of_range_numpy_values_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"tp_size: expected an integer in \[1, 256\]"):
        check("tp_size", value, TP)


@pytest.mark.parametrize("value", [2**63, 10**400, np.uint64(2**63)])
def test_integers_just_past_or_far_past_the_top_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="seed: expected an integer"):
        check("seed", value, SEED)
