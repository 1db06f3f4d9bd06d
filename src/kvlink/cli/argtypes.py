"""argparse value types shared by the bench commands."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def _dirs_made_for(path: Path) -> Iterator[None]:
    """Make `path` and its missing parents for the body of the block; when the making or
    the body fails (OSError), remove again the directories made here."""
    made: list[Path] = []
    try:
        for directory in [p for p in (path, *path.parents) if not p.exists()][::-1]:
            directory.mkdir(exist_ok=True)
            made.append(directory)
        yield
    except OSError:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def output_file(text: str) -> Path:
    """A file a command writes when it is done, checked before it starts, so that a long run
    does not end in a traceback over a path it could never write. An existing file (or link)
    must be writable and is left as it is; for a new one, its directory is made (and stays)
    and a file is created there and removed again."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}" + (" (a directory)" if text else ""))
    if os.path.lexists(path):
        if not os.access(path, os.W_OK):  # a dangling link too: its target does not exist
            raise argparse.ArgumentTypeError(f"cannot write {text}: not writable or a link to nowhere")
        return path
    try:
        with _dirs_made_for(path.parent):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            path.unlink()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {error.strerror or error}") from None
    return path


def png_file(text: str) -> Path:
    """An `output_file` for a chart: the charts are PNG, and the name must say so (matplotlib
    picks the format by the suffix, and would fail on another only after the run)."""
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"expected a .png file path, got {text!r}")
    return output_file(text)


def output_dir(text: str) -> Path:
    """A directory a command writes into: made now (and kept), and checked writable (a file is
    created and removed in it); what was made is removed again when the check fails."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("expected a directory path, got ''")
    try:
        with _dirs_made_for(path), tempfile.NamedTemporaryFile(dir=path, prefix=".kvlink-write-check-"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {error.strerror or error}") from None
    return path
