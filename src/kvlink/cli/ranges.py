"""argparse `type=` factories that refuse out-of-range values (exit 2, naming the option and range).

The ranges are those of `kvlink.layout.limits`, so a command line refuses exactly what
the constructor behind it would; argparse adds the option name to the message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvlink.layout.limits import Bound, range_problem


def _parse(text: str, bound: Bound) -> int | float:
    try:
        value: int | float = int(text) if bound.integer else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {bound.describe()}, got {text!r}") from None
    problem = range_problem(value, bound)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def ranged(bound: Bound) -> Callable[[str], int | float]:
    """`type=ranged(TOKENS)`: an int (or float) inside `bound`."""
    def parse(text: str) -> int | float:
        return _parse(text, bound)
    return parse


def ranged_list(bound: Bound) -> Callable[[str], list[int | float]]:
    """`type=ranged_list(TOKENS)`: comma-separated values, each inside `bound`, at least one."""
    def parse(text: str) -> list[int | float]:
        values = [_parse(item.strip(), bound) for item in text.split(",") if item.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, each {bound.describe()}; "
                                             f"got {text!r}")
        return values
    return parse
