"""argparse value types shared by the bench commands."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
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


def output_file(text: str) -> Path:
    """A file a command writes when it is done: checked before it starts (its directory is
    made and the file opened for writing; one made only for the check is removed again), so a
    long run does not end in a traceback over a path it could never write."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}" + (" (a directory)" if text else ""))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {error.strerror or error}") from None
    return path


def output_dir(text: str) -> Path:
    """A directory a command writes into: made now, and checked writable (a file is created
    and removed in it)."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("expected a directory path, got ''")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvlink-write-check-"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {error.strerror or error}") from None
    return path
