"""The allowed range of every size, count, port and duration kvlink takes, and one check for them.

Every public constructor and command line option that takes such a value checks it
here before anything is allocated, so a hostile or absurd value ends in a ValueError
(or exit 2) that names the option, the value and the range, never in a MemoryError
or a hang. Dataclasses declare their ranges per field with `bounded(...)` and call
`check_fields(self)` in `__post_init__`, so any loader that builds them from a dict
(an engine's extra config, a wire message) gets the same checks.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

MAX_TP = 256
"""TP ranks of one engine (wider than any KV-head sharding in use; keeps all-rank planning fast)."""
MAX_TOKENS = 2**24
"""Tokens of one request (prompt, completion, context length): 16 Mi."""
MAX_BLOCK_SIZE = 2**16
"""Tokens per logical or kernel block."""
MAX_NUM_BLOCKS = 2**24
"""Logical blocks of one KV pool."""
MAX_MODEL_DIM = 2**20
"""Any one model dimension: KV heads, head dim, latent dim, SSM heads, groups, state."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Any lease, timeout, deadline or duration: one week."""
MAX_PORT = 65535
MAX_PLAN_BYTES = 2**30
"""Prepared descriptor lists (both sides, every source rank) of one transfer plan."""


@dataclass(frozen=True)
class Bound:
    """An inclusive range `[low, high]`; `integer` values must be ints (bools refused)."""

    low: float
    high: float
    integer: bool = True
    allow_none: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        return f"{kind} in [{_show(self.low)}, {_show(self.high)}]"


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def int_range(low: int, high: int, allow_none: bool = False) -> Bound:
    return Bound(low, high, integer=True, allow_none=allow_none)


def float_range(low: float, high: float, allow_none: bool = False) -> Bound:
    return Bound(low, high, integer=False, allow_none=allow_none)


TP = int_range(1, MAX_TP)
TOKENS = int_range(1, MAX_TOKENS)
TOKENS_OR_ZERO = int_range(0, MAX_TOKENS)
BLOCK_SIZE = int_range(1, MAX_BLOCK_SIZE)
NUM_BLOCKS = int_range(1, MAX_NUM_BLOCKS)
MODEL_DIM = int_range(1, MAX_MODEL_DIM)
PORT = int_range(1, MAX_PORT)
PORT_OR_EPHEMERAL = int_range(0, MAX_PORT)
SECONDS = float_range(1e-3, MAX_SECONDS)
SECONDS_OR_ZERO = float_range(0.0, MAX_SECONDS)
COUNT = int_range(1, 10**6)
"""Requests, repeats, rounds, batch sizes."""
CONCURRENCY = int_range(1, 1024)
THREADS = int_range(1, 1024)
SEED = int_range(0, 2**63 - 1)
FRACTION = float_range(0.0, 1.0)


def range_problem(value: object, bound: Bound) -> str | None:
    """Why `value` is outside `bound` (None when it is inside)."""
    if value is None and bound.allow_none:
        return None
    # numbers.* so numpy scalars from an engine's arrays pass like Python ints and floats.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"expected {bound.describe()}, got {type(value).__name__} {value!r}"
    if bound.integer and not isinstance(value, numbers.Integral):
        return f"expected {bound.describe()}, got {value!r}"
    # Integers compare exactly (no float rounding at 2**63, no overflow for huge ones).
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(number, float) and not math.isfinite(number):
        return f"expected {bound.describe()}, got {value!r}"
    if not bound.low <= number <= bound.high:
        return f"expected {bound.describe()}, got {value!r}"
    return None


def check(name: str, value: Any, bound: Bound) -> Any:
    """`value` unchanged if inside `bound`; else ValueError naming `name`, the value and the range."""
    problem = range_problem(value, bound)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    return value


def bounded(bound: Bound, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field (with `default`, if given) whose range `check_fields` enforces."""
    return dataclasses.field(default=default, metadata={"bound": bound})


def check_fields(obj: Any) -> None:
    """Check every field of dataclass `obj` declared with `bounded` (ValueError on the first bad one)."""
    for f in dataclasses.fields(obj):
        bound = f.metadata.get("bound")
        if bound is not None:
            check(f.name, getattr(obj, f.name), bound)
