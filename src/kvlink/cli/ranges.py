"""argparse `type=` factories that refuse out-of-range values (exit 2, naming the option and range).

The ranges are those of `kvlink.layout.limits`, so a command line refuses exactly what
the constructor behind it would; argparse adds the option name to the message.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ranged:  # lower case: used like a function, `type=ranged(TOKENS)`
    """`type=ranged(TOKENS)`: an int (or float) inside `bound`."""

    bound: Bound

    def __call__(self, text: str) -> int | float:
        return _parse(text, self.bound)


@dataclass(frozen=True)
class ranged_list:
    """`type=ranged_list(TOKENS)`: comma-separated values, each inside `bound`, at least one."""

    bound: Bound

    def __call__(self, text: str) -> list[int | float]:
        values = [_parse(item.strip(), self.bound) for item in text.split(",") if item.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, each "
                                             f"{self.bound.describe()}; got {text!r}")
        return values
