"""argparse value types shared by the bench commands."""

from __future__ import annotations

import argparse
import json
from typing import Any


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def name_subset(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated subset of `known`, in the order given, without repeats."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(known)}; got {text!r}")
    return names


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not name.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value
